"""Rendezvous endpoints for torch's elastic agent (`worker.rendezvous` is their client).

Every endpoint is under `/v1/rdzv/{rdzv_id}` where `rdzv_id` is `<job id>-a<attempt>`. It is
open to that job's own token and to the credential of a node that is a member of the job;
any other principal's token is 403 (the user token, the node token, another job's token, a
node that is not a member). An unknown job is 404 to a node, 401 to a token that is not
its; an attempt that is not the job's current one, or a finished job, is 410 Gone, and a
client must not retry a 410. Bytes travel base64 (standard alphabet) in JSON.
`GET /state?after=<token>&wait_s=<s>` is a long poll on the state (a torch agent waiting for
other nodes); without `after` it is the plain read torch's `get_state` makes.
The logic is in `service.rendezvous.Rendezvous`; these handlers only translate.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Response, status

from service.api_contract import AuthFirstRoute
from service.deps import (
    ContextDep,
    JobCredentials,
    NodeCredentials,
    _node_of_credential,
    credential_digest,
    job_of_token,
    token_matches,
    unauthorized,
    verify_node,
)
from service.rendezvous import Rendezvous, RendezvousGone, parse_rdzv_id, state_token
from worker.protocol import (
    AddRequest,
    AddResult,
    AppendRequest,
    CompareSetRequest,
    DeleteRequest,
    DeleteResult,
    GetRequest,
    GetResult,
    NumKeysResult,
    RdzvState,
    SetRequest,
    SetStateRequest,
    SetStateResult,
    StateChange,
    ValueResult,
)


async def current_rendezvous(
    ctx: ContextDep, job_creds: JobCredentials, node_creds: NodeCredentials,
    rdzv_id: Annotated[str, Path(max_length=200)]
) -> Rendezvous:
    """The caller's rendezvous, after checking its token and that its attempt is current."""
    creds = job_creds or node_creds  # one header: the OpenAPI names both schemes
    job_id, attempt = parse_rdzv_id(rdzv_id)
    if ctx.settings.node_token is not None and creds is None:
        raise unauthorized("missing 'Authorization: Bearer <token>' (the job token in "
                            "FTRAIN_JOB_TOKEN, or a member node's credential)")
    given = None if ctx.settings.node_token is None else creds.credentials
    job = _cached_job(ctx, given, job_id, attempt)
    if job is None and given is not None:
        job = await _job_of_caller(ctx, given, job_id)
    elif job is None:
        job = await ctx.jobs.get(job_id)
    if job.state.is_terminal():
        raise RendezvousGone(f"job {job_id} is {job.state.value}; its rendezvous {rdzv_id} is "
                             "closed. The agent should stop.")
    if attempt != job.attempt:
        raise RendezvousGone(f"rendezvous {rdzv_id} belongs to attempt {attempt} of job {job_id}, "
                             f"which is now at attempt {job.attempt} ({job.rdzv_id}); this agent "
                             "is stale and should stop.")
    ctx.rdzv_states.attempt_seen(ctx.kv, ctx.keys, job_id, attempt)
    return Rendezvous(ctx.kv, ctx.keys, rdzv_id, ctx.rdzv_states,
                      expected_nodes=ctx.rdzv_states.live_members(job),
                      long_poll_s=ctx.settings.long_poll_s)


def _cached_job(ctx, given: str | None, job_id: str, attempt: int):
    """The job as the watch-fed index has it, if that alone answers this request: the caller
    is the job's token (`given`; None: an open cluster), the index has the job unfinished and
    at `attempt` or newer (a newer one is a 410 either way: attempts only grow). None
    otherwise (a node's credential, which is verified in etcd; a job the index lacks, has
    finished or at an older attempt; a token that does not match): read from etcd as before.

    A rendezvous request used to read the job from etcd (and parse every member) each time:
    a round of N nodes makes several requests a node. The index may lag etcd by a watch
    event; a request it lets through for an attempt that has just ended only reaches that
    attempt's own keys (the module docstring of `service.rendezvous`: fencing of attempts)."""
    job = ctx.index.get(job_id)
    if job is None or job.attempt < attempt or job.state.is_terminal():
        return None
    if given is not None and (_node_of_credential(given) is not None
                              or not token_matches(given, ctx.job_token(job))):
        return None
    return job


async def _job_of_caller(ctx, given: str, job_id: str):
    """The job, if `given` is its token or the credential of a live member node; else 401/403."""
    node = _node_of_credential(given)
    if node is not None:
        await verify_node(ctx, node, credential_digest(given))
        job = await ctx.jobs.get(job_id)
        if node not in job.members:
            raise HTTPException(status.HTTP_403_FORBIDDEN,
                                f"node {node!r} is not a member of job {job_id}")
        return job
    return await job_of_token(ctx, given, job_id, f"join job {job_id}'s rendezvous", "rendezvous endpoints")


RendezvousDep = Annotated[Rendezvous, Depends(current_rendezvous)]

router = APIRouter(prefix="/v1/rdzv/{rdzv_id}", tags=["rendezvous"], route_class=AuthFirstRoute)


def _answer(ctx, entry, **flags: bool) -> Response:
    """A state answer (`RdzvState` and its `flags`) as JSON, the state encoded once per revision
    (`StateHub.encoded`): N nodes read the same large state, and pydantic's encoding of it
    for each one was most of the control plane's time in a round."""
    outage = ctx.contact.recent_outage()
    head = '{"state":null,"token":null' if entry is None else \
        f'{{"state":"{ctx.rdzv_states.encoded(entry)}","token":"{state_token(entry)}"'
    tail = "".join(f',"{name}":{"true" if value else "false"}' for name, value in flags.items())
    body = f'{head},"outage":{"null" if outage is None else outage.model_dump_json()}{tail}}}'
    return Response(body.encode(), media_type="application/json")


@router.get("/state", response_model=StateChange | RdzvState)
async def get_state(
    rdzv: RendezvousDep,
    ctx: ContextDep,
    after: Annotated[str | None, Query(pattern=r"^[0-9]{1,19}$",
                                       description="Long poll: answer once the token is not this "
                                                   "one (\"0\": no state yet).")] = None,
    wait_s: Annotated[float, Query(ge=0, le=600,
                                   description="How long to wait for that (at most the control "
                                               "plane's `long_poll_s`).")] = 0.0,
    shape: Annotated[str | None, Query(pattern=r"^[0-9a-f]{16}$",
                                       description="Long poll: the `shape` of the state at `after`; "
                                                   "a change of heartbeats only does not answer.")] = None,
    progress: Annotated[str | None, Query(pattern=r"^[0-9a-f]{16}$",
                                          description="Long poll: the `progress` of the state at "
                                                      "`after` (round, complete, closed, deadline); "
                                                      "only a change of it answers.")] = None,
    alive: Annotated[str | None, Query(pattern=r"^[0-9]{1,10},[0-9]{1,10},[^,]{1,255}$",
                                       description="Long poll: '<pid>,<local_id>,<addr>' of the node "
                                                   "waiting, to be kept alive while it waits "
                                                   "(`kept_alive` says if it is; then an answer with "
                                                   "nothing changed comes without the state).")] = None,
    beat_s: Annotated[float, Query(gt=0, le=3600, description="With `alive`: the node's keep-alive "
                                                              "interval, s.")] = 5.0,
) -> Response:
    """The rendezvous state and its token (both null before the first `set_state`); with
    `after`, once its token differs from `after` or `wait_s` has passed (`changed` says which)."""
    if after is None:
        return _answer(ctx, await rdzv.read_state())
    if alive is None:
        entry, changed = await rdzv.wait_for_state_change(after, wait_s, shape, progress)
        return _answer(ctx, entry, changed=changed)
    pid, local_id, addr = alive.split(",", 2)
    node = (addr, int(pid), int(local_id))
    entry, changed = await rdzv.wait_for_state_change(after, wait_s, shape, progress, (node, beat_s))
    kept = rdzv.kept_alive(node)
    if kept and not changed:
        return _answer(ctx, None, changed=False, kept_alive=True)
    return _answer(ctx, entry, changed=changed, kept_alive=kept)


@router.put("/state", response_model=SetStateResult)
async def set_state(body: SetStateRequest, rdzv: RendezvousDep, ctx: ContextDep) -> Response:
    """Compare-and-set: write iff `token` is current (null: iff none yet), or with `merge`, apply
    its ops to the state as it is now; returns what is there and whether this change is in it."""
    entry, written = await rdzv.set_state(body.state, body.token, body.merge)
    return _answer(ctx, entry, written=written)


@router.post("/store/get", response_model=GetResult, response_model_exclude_none=True)
async def store_get(body: GetRequest, rdzv: RendezvousDep) -> GetResult:
    """Values of `keys` once all exist (long poll of up to `wait_s`, at most the control
    plane's `long_poll_s`); else found=false."""
    values = await rdzv.get(body.keys, body.wait_s)
    if values is None:
        return GetResult(found=False)
    return GetResult(found=True, values=values if body.values else None)


@router.post("/store/set", status_code=status.HTTP_204_NO_CONTENT)
async def store_set(body: SetRequest, rdzv: RendezvousDep) -> None:
    """Set one key (set) or several (multi_set)."""
    await rdzv.set([(item.key, item.value) for item in body.items])


@router.post("/store/add", response_model=AddResult)
async def store_add(body: AddRequest, rdzv: RendezvousDep) -> AddResult:
    """Atomically add `amount` to an integer key (absent: 0); returns the new value."""
    return AddResult(value=await rdzv.add(body.key, body.amount, body.op_id))


@router.post("/store/append", status_code=status.HTTP_204_NO_CONTENT)
async def store_append(body: AppendRequest, rdzv: RendezvousDep) -> None:
    await rdzv.append(body.key, body.value, body.op_id)


@router.post("/store/compare_set", response_model=ValueResult)
async def store_compare_set(body: CompareSetRequest, rdzv: RendezvousDep) -> ValueResult:
    """TCPStore's compare_set: the value after the attempt (see `Rendezvous.compare_set`)."""
    return ValueResult(value=await rdzv.compare_set(body.key, body.expected, body.desired))


@router.post("/store/delete", response_model=DeleteResult)
async def store_delete(body: DeleteRequest, rdzv: RendezvousDep) -> DeleteResult:
    return DeleteResult(deleted=await rdzv.delete(body.key))


@router.get("/store/num_keys", response_model=NumKeysResult)
async def store_num_keys(rdzv: RendezvousDep) -> NumKeysResult:
    return NumKeysResult(count=await rdzv.num_keys())
