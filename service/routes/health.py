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
    """Ready to serve: etcd answers. 503 with the reason when it does not."""
    try:
        await ctx.kv.revision()
    except StoreUnavailable as exc:
        return JSONResponse({"status": "unavailable", "reason": exc.message}, status_code=503)
    return {"status": "ok", "etcd": ctx.kv.endpoint}
