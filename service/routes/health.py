from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from service.deps import ContextDep
from service.errors import StoreUnavailable
from service.routes.goodput import refresh_goodput

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
async def metrics(ctx: ContextDep) -> PlainTextResponse:
    """Prometheus metrics of this replica: jobs by state, restarts, recovery time, snapshot
    stall/write/commit, heartbeat and etcd latency, scheduler passes (`service.telemetry`), and
    the jobs' seconds by cause and the nodes' by state (`service.goodput`: etcd is read for the
    events of jobs that changed since the last scrape)."""
    await refresh_goodput(ctx)
    return PlainTextResponse(ctx.telemetry.render(), media_type=CONTENT_TYPE_LATEST)

