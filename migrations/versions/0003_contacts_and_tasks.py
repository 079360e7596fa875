"""Local contacts and tasks tables for search_contacts and create_task

``contacts`` (search_contacts' local backend; ``email`` unique, the demo loader's
natural key) and ``todo_tasks`` (create_task's; ``tool_call_id`` unique so a
redelivered CREATING link never adds a second task).

Revision ID: 0003
Revises: 0002
"""
from alembic import op  # noqa: F401
import sqlalchemy as sa  # noqa: F401

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'contacts',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('name', sa.String(length=200), nullable=False),
        sa.Column('email', sa.String(length=320), nullable=True),
        sa.Column('phone', sa.String(length=50), nullable=True),
        sa.Column('organization', sa.String(length=200), nullable=True),
        sa.Column('notes', sa.Text(), server_default='', nullable=False),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('email'),
    )
    op.create_table(
        'todo_tasks',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tool_call_id', sa.String(length=100), nullable=False),
        sa.Column('title', sa.String(length=500), nullable=False),
        sa.Column('notes', sa.Text(), server_default='', nullable=False),
        sa.Column('due', sa.Date(), nullable=True),
        sa.Column('priority', sa.String(length=10), server_default='medium', nullable=False),
        sa.Column('status', sa.String(length=20), server_default='needsAction', nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.CheckConstraint("priority IN ('low', 'medium', 'high')", name='ck_todo_tasks_priority'),
        sa.CheckConstraint("status IN ('needsAction', 'completed')", name='ck_todo_tasks_status'),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('tool_call_id'),
    )


def downgrade() -> None:
    op.drop_table('todo_tasks')
    op.drop_table('contacts')
