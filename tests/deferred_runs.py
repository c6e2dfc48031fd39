"""A run that ends waiting: one call deferred for each thing a call can wait for, beside one that ran.

The read-side tests (the API, the explorer, the CLI, `/metrics`) read this run: its status is
`waiting`, its `refund`, `ask_customer` and `export` calls are `deferred` (for `approval`, a
`question` and an `external` system), and its `lookup` call `completed`.
"""

from __future__ import annotations

from pydantic_ai import Agent, CallDeferred, DeferredToolRequests
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from stepstream.producer import StepLog, StepPersistence
from stepstream.readmodel import ProjectionReader, resume_run

REFUND_ARGS = {'amount': 120, 'reason': '<b>charged twice</b>'}
"""The approval call's arguments: markup in them must show as text, never as markup."""
EXPORT_METADATA = {'job': 'export-7'}
"""What the external call defers with."""
DEFERRALS = {'refund': 'approval', 'ask_customer': 'question', 'export': 'external'}
"""Each deferred call's tool and what it waits for."""


def _model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    if len(messages) > 1:  # never reached: the run ends with the deferred calls
        return ModelResponse(parts=[TextPart('done')])
    return ModelResponse(
        parts=[
            ToolCallPart('refund', REFUND_ARGS, tool_call_id='call-refund'),
            ToolCallPart('ask_customer', {'question': 'which card?'}, tool_call_id='call-ask'),
            ToolCallPart('export', {'table': 'orders'}, tool_call_id='call-export'),
            ToolCallPart('lookup', {'order': 7}, tool_call_id='call-lookup'),
        ]
    )


def waiting_agent(
    log: StepLog, run_id: str | None, *, agent_name: str = 'refunds', metadata: dict[str, str] | None = None
) -> Agent[None, str | DeferredToolRequests]:
    """The agent whose first run ends waiting on its three deferred calls, writing to `log` as `run_id`."""
    agent: Agent[None, str | DeferredToolRequests] = Agent(
        FunctionModel(_model),
        capabilities=[
            StepPersistence(log=log, agent_name=agent_name, run_id=run_id, metadata=metadata or {})
        ],
        output_type=[str, DeferredToolRequests],
    )

    @agent.tool_plain(requires_approval=True)
    def refund(amount: int, reason: str) -> str:
        return 'refunded'

    @agent.tool_plain
    def ask_customer(question: str) -> str:
        raise CallDeferred(kind='question')

    @agent.tool_plain
    def export(table: str) -> str:
        raise CallDeferred(metadata=EXPORT_METADATA)

    @agent.tool_plain
    def lookup(order: int) -> str:
        return 'order 7: two charges'

    return agent


async def run_until_waiting(
    log: StepLog, run_id: str, *, agent_name: str = 'refunds'
) -> DeferredToolRequests:
    """Run the agent on `log` as `run_id` until it ends waiting on its three deferred calls."""
    result = await waiting_agent(log, run_id, agent_name=agent_name).run(
        'refund order 7', conversation_id=f'conv-{run_id}'
    )
    assert isinstance(result.output, DeferredToolRequests), result.output
    return result.output


async def resume(log: StepLog, reader: ProjectionReader, run_id: str, resumed_run_id: str) -> str:
    """Resume the decided run `run_id` from the projection as `resumed_run_id`; its answer."""
    resumption = await resume_run(reader, run_id)
    agent = waiting_agent(log, resumed_run_id, metadata=resumption.metadata)
    result = await agent.run(**resumption.run_kwargs())
    assert isinstance(result.output, str), result.output
    return result.output
