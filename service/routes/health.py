from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from service.deps import ContextDep
from service.errors import StoreUnavailable

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    """The process is alive (it does not ask etcd)."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(ctx: ContextDep):
    """Ready to serve: etcd answers and takes writes. 503 with the reason when it does not
    (etcd away, or its NOSPACE alarm raised: then the reason says what to do)."""
    try:
        await ctx.kv.check_ready()
    except StoreUnavailable as exc:
        return JSONResponse({"status": "unavailable", "reason": exc.message}, status_code=503)
    return {"status": "ok", "etcd": ctx.kv.endpoint}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(ctx: ContextDep) -> str:
    """This replica's scheduler pass time, in Prometheus' text format (no etcd read): a
    summary over its last passes while it led, with a count and a sum since it started."""
    p = ctx.scheduler_passes
    name = "ftrain_scheduler_pass_seconds"
    lines = [f"# HELP {name} Duration of one scheduler pass (read, plan, write) on this replica.",
             f"# TYPE {name} summary"]
    for q in (0.5, 0.99):
        value = p.quantile(q)
        lines.append(f'{name}{{quantile="{q}"}} {"NaN" if value is None else f"{value:.6f}"}')
    lines += [f"{name}_sum {p.sum_s:.6f}", f"{name}_count {p.count}"]
    return "\n".join(lines) + "\n"
