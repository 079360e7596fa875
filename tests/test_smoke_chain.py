from sqlalchemy import func, select

from models import db
from models.email import EmailOutbox
from tasks.calls import actions
from tests.helpers import make_call, wait_status


def test_send_email_runs_to_checkpoint_then_completes(worker, relay):
    call = make_call(callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    prepared = wait_status(call.tool_call_id, "PREPARED")
    assert prepared.current_step == "READY_TO_SEND"
    checkpoint = relay.wait_for(call.tool_call_id, "checkpoint")
    assert checkpoint["requires_confirmation"] is True
    assert checkpoint["message"] == "The email to john@example.com is ready. Send it?"
    actions.resume(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    assert done.status == "COMPLETED", done.error_message
    assert done.result["to"] == "john@example.com"
    relay.wait_for(call.tool_call_id, "completed")
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(EmailOutbox)) == 1
    assert relay.bad_signatures == 0
