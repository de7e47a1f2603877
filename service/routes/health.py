from fastapi import APIRouter
from fastapi.responses import JSONResponse

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
