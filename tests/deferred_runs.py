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


async def run_until_waiting(
    log: StepLog, run_id: str, *, agent_name: str = 'refunds'
) -> DeferredToolRequests:
    """Run the agent on `log` as `run_id` until it ends waiting on its three deferred calls."""
    agent = Agent(
        FunctionModel(_model),
        capabilities=[StepPersistence(log=log, agent_name=agent_name, run_id=run_id)],
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

    result = await agent.run('refund order 7', conversation_id=f'conv-{run_id}')
    assert isinstance(result.output, DeferredToolRequests), result.output
    return result.output
