"""The JSON API of deferred calls: what waits across runs, and a person's decision on one call.

`GET /api/deferred` lists the calls that wait; `POST /api/runs/{run_id}/calls/{tool_call_id}/approve`,
`/deny` and `/complete` write a decision (behind the service's token, as the resolve route). A
decision that stands answers 201 (202 when written but not shown by the projection yet), one that
does not 409 with the decision that stands.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from fastapi import APIRouter, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from stepstream.schemas import MAX_NOTE_CHARS, Decision
from stepstream.serve._decisions import Decisions, Refused
from stepstream.serve._models import Decided, DecisionConflict, DeferredPage, Problem

router = APIRouter(
    prefix='/api',
    responses={
        503: {
            'model': Problem,
            'description': 'A shard this read needs is not readable here (ShardUnavailable).',
        }
    },
)

RunId = Annotated[str, Path(description='The run_id.')]
CallId = Annotated[str, Path(description='The deferred tool call.')]
DECIDE_RESPONSES: dict[int | str, dict[str, Any]] = {
    201: {'model': Decided, 'description': 'Written, and the projection shows it decides the call.'},
    202: {
        'model': Decided,
        'description': 'Written (the broker acknowledged it); the projection does not show it yet: '
        'read the call again to learn whether it decides.',
    },
    404: {'model': Problem, 'description': 'No such run, or no such call in it.'},
    409: {
        'model': DecisionConflict,
        'description': 'The call does not wait: decided already (`decision`: the one that stands), or '
        'never deferred; or a decision earlier in the log won (`written`: this one, kept as history).',
    },
    422: {
        'description': 'A decision the call cannot take (an approval of an outside call, ...), or a bad body.'
    },
}


def decisions(request: Request) -> Decisions:
    """The service's `Decisions` (set by `create_app`)."""
    found: Decisions = request.app.state.decisions
    return found


def refused_input(exc: ValueError, where: str = 'body') -> RequestValidationError:
    """A `ValueError` of the decision's rules as FastAPI's 422 (one shape for every bad input)."""
    return RequestValidationError([{'loc': (where,), 'msg': str(exc), 'type': 'value_error'}])


@router.get(
    '/deferred',
    response_model=DeferredPage,
    summary='Deferred calls that wait',
    responses={400: {'model': Problem, 'description': "An `after` that is no page's `next_after`."}},
)
async def waiting(
    request: Request,
    agent: Annotated[str | None, Query(description="Only calls of this agent's runs.")] = None,
    conversation: Annotated[str | None, Query(description='Only calls of runs in this conversation.')] = None,
    kind: Annotated[
        Literal['approval', 'question', 'external'] | None, Query(description='Only calls waiting for this.')
    ] = None,
    newest: Annotated[bool, Query(description='Newest first (default: the longest waiting first).')] = False,
    after: Annotated[str | None, Query(description="The previous page's next_after.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> DeferredPage:
    """The deferred calls that wait for a decision, across runs, in the order they were deferred.

    Each says what it waits for (`kind`), its arguments as stored, its tool's metadata, its run's
    agent and conversation, since when and how long it has waited. A call leaves the list once a
    decision on it is applied.
    """
    return await decisions(request).waiting(
        agent_name=agent,
        conversation_id=conversation,
        kind=kind,
        newest_first=newest,
        after=after,
        limit=limit,
    )


class DecisionRequest(BaseModel):
    """What every decision on a deferred call may say besides its outcome."""

    note: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NOTE_CHARS,
        description='Why (redacted before it is written).',
    )
    operator: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="Who decides; default: the service's STEPSTREAM_OPERATOR (or its OS user).",
    )


class ApproveRequest(DecisionRequest):
    """Let a call that waits for an approval run."""

    args: dict[str, Any] | None = Field(
        default=None, description='The arguments it runs with instead of its own (redacted as stored).'
    )


class DenyRequest(DecisionRequest):
    """Refuse a call that waits for an approval: it does not run, the model is told `message`."""

    message: str = Field(min_length=1, max_length=MAX_NOTE_CHARS, description='What the model is told.')


class CompleteRequest(DecisionRequest):
    """Give a question's or an outside call's outcome: its `result` (any JSON value) or its `error`."""

    model_config = ConfigDict(
        json_schema_extra={'oneOf': [{'required': ['result']}, {'required': ['error']}]}
    )

    result: Any = Field(default=None, description='The result (any JSON value, null included).')
    error: str | SkipJsonSchema[None] = Field(
        default=None, min_length=1, max_length=MAX_NOTE_CHARS, description='The call failed: why.'
    )

    @model_validator(mode='after')
    def _one_outcome(self) -> Self:
        if ('result' in self.model_fields_set) == (self.error is not None):
            raise ValueError('give the result or the error, not both and not neither')
        return self


async def _decide(
    request: Request, run_id: str, call: str, decision: Decision, body: DecisionRequest, **what: Any
) -> Response:
    """Write the decision; 201 (202 not shown yet) with it, 409 with the one that stands."""
    try:
        decided = await decisions(request).decide(
            run_id, call, decision=decision, operator=body.operator, note=body.note, **what
        )
    except Refused as exc:
        return JSONResponse(exc.conflict.model_dump(mode='json'), status_code=409)
    except ValueError as exc:  # a decision the call cannot take, an operator name the log refuses
        raise refused_input(exc) from None
    return JSONResponse(decided.model_dump(mode='json'), status_code=201 if decided.applied else 202)


@router.post(
    '/runs/{run_id}/calls/{tool_call_id}/approve',
    summary='Approve a deferred call',
    status_code=201,
    response_model=Decided,
    responses=DECIDE_RESPONSES,
)
async def approve(request: Request, run_id: RunId, tool_call_id: CallId, body: ApproveRequest) -> Response:
    """Let a call that waits for an approval run, with `args` in place of its own when given."""
    return await _decide(request, run_id, tool_call_id, 'approved', body, args=body.args)


@router.post(
    '/runs/{run_id}/calls/{tool_call_id}/deny',
    summary='Deny a deferred call',
    status_code=201,
    response_model=Decided,
    responses=DECIDE_RESPONSES,
)
async def deny(request: Request, run_id: RunId, tool_call_id: CallId, body: DenyRequest) -> Response:
    """Refuse a call that waits for an approval: it never runs, and the model is told `message`."""
    return await _decide(request, run_id, tool_call_id, 'denied', body, message=body.message)


@router.post(
    '/runs/{run_id}/calls/{tool_call_id}/complete',
    summary="Give a deferred call's result or error",
    status_code=201,
    response_model=Decided,
    responses=DECIDE_RESPONSES,
)
async def complete(request: Request, run_id: RunId, tool_call_id: CallId, body: CompleteRequest) -> Response:
    """The outcome of a call that waits for an answer or an outside system: `result` or `error`."""
    if body.error is not None:
        return await _decide(request, run_id, tool_call_id, 'failed', body, message=body.error)
    return await _decide(request, run_id, tool_call_id, 'returned', body, result=body.result)
