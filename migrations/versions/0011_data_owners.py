"""The tools' local data belongs to a caller: an owner column in each local backend table

A row of the local backends belongs to the caller (a token's name) whose call wrote it, or to
'' (the shared set every caller sees: the demo data, documents ingested without an owner);
docs/promises.md, Callers. ``owner`` is added to ``calendar_events``, ``contacts``,
``todo_tasks``, ``email_outbox``, ``documents``, ``learners`` and ``training_modules``; every row
already stored gets '' (shared). ``training_progress`` and ``knowledge_questions`` belong to
their learner and module. Natural keys become per owner (a contact's address, a learner's
address, a document chunk's id) and the indexes the reads use lead with ``owner``.

Revision ID: 0011
Revises: 0010
"""
from alembic import op
import sqlalchemy as sa

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

OWNED = ('calendar_events', 'contacts', 'todo_tasks', 'email_outbox', 'documents', 'learners', 'training_modules')


def upgrade() -> None:
    for table in OWNED:
        op.add_column(table, sa.Column('owner', sa.String(length=100), nullable=False, server_default=''))

    op.drop_index('idx_calendar_events_span', table_name='calendar_events')
    op.create_index('idx_calendar_events_owner_span', 'calendar_events', ['owner', 'starts_at', 'ends_at'])

    op.drop_constraint('contacts_email_key', 'contacts', type_='unique')
    op.create_unique_constraint('uq_contacts_owner_email', 'contacts', ['owner', 'email'])

    op.create_index('ix_todo_tasks_owner', 'todo_tasks', ['owner'])
    op.create_index('ix_email_outbox_owner', 'email_outbox', ['owner'])

    op.drop_constraint('documents_pkey', 'documents', type_='primary')
    op.create_primary_key('documents_pkey', 'documents', ['owner', 'id'])
    op.drop_index('ix_documents_document_id', table_name='documents')
    op.create_index('ix_documents_owner_document_id', 'documents', ['owner', 'document_id'])

    op.drop_index('uq_learners_email_lower', table_name='learners')
    op.create_index('uq_learners_owner_email_lower', 'learners', ['owner', sa.text('lower(email)')], unique=True)
    op.create_index('ix_training_modules_owner', 'training_modules', ['owner'])


def downgrade() -> None:
    # one row per natural key again: the shared row (or the first owner's, by name) stays
    op.execute("DELETE FROM contacts AS a USING contacts AS b WHERE a.email = b.email AND a.owner > b.owner")
    op.execute("DELETE FROM learners AS a USING learners AS b "
               "WHERE lower(a.email) = lower(b.email) AND a.owner > b.owner")
    op.execute("DELETE FROM documents AS a USING documents AS b WHERE a.id = b.id AND a.owner > b.owner")

    op.drop_index('ix_training_modules_owner', table_name='training_modules')
    op.drop_index('uq_learners_owner_email_lower', table_name='learners')
    op.create_index('uq_learners_email_lower', 'learners', [sa.text('lower(email)')], unique=True)

    op.drop_index('ix_documents_owner_document_id', table_name='documents')
    op.create_index('ix_documents_document_id', 'documents', ['document_id'])
    op.drop_constraint('documents_pkey', 'documents', type_='primary')
    op.create_primary_key('documents_pkey', 'documents', ['id'])

    op.drop_index('ix_email_outbox_owner', table_name='email_outbox')
    op.drop_index('ix_todo_tasks_owner', table_name='todo_tasks')

    op.drop_constraint('uq_contacts_owner_email', 'contacts', type_='unique')
    op.create_unique_constraint('contacts_email_key', 'contacts', ['email'])

    op.drop_index('idx_calendar_events_owner_span', table_name='calendar_events')
    op.create_index('idx_calendar_events_span', 'calendar_events', ['starts_at', 'ends_at'])

    for table in OWNED:
        op.drop_column(table, 'owner')
