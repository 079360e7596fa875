"""Training tables (learners, modules, progress, questions) for get_training_progress and knowledge_check

Revision ID: 0005
Revises: 0004
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('learners',
    sa.Column('id', sa.String(length=50), nullable=False),
    sa.Column('email', sa.String(length=254), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('uq_learners_email_lower', 'learners', [sa.text('lower(email)')], unique=True)
    op.create_table('training_modules',
    sa.Column('id', sa.String(length=100), nullable=False),
    sa.Column('title', sa.String(length=200), nullable=False),
    sa.Column('description', sa.Text(), server_default='', nullable=False),
    sa.Column('lesson_count', sa.Integer(), nullable=False),
    sa.CheckConstraint('lesson_count > 0', name='training_modules_lessons_positive'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('training_progress',
    sa.Column('learner_id', sa.String(length=50), nullable=False),
    sa.Column('module_id', sa.String(length=100), nullable=False),
    sa.Column('lessons_completed', sa.Integer(), server_default='0', nullable=False),
    sa.Column('status', sa.String(length=20), server_default='not_started', nullable=False),
    sa.Column('score', sa.Integer(), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("status IN ('not_started', 'in_progress', 'completed')", name='training_progress_status'),
    sa.CheckConstraint('lessons_completed >= 0', name='training_progress_lessons'),
    sa.CheckConstraint('score IS NULL OR (score >= 0 AND score <= 100)', name='training_progress_score'),
    sa.ForeignKeyConstraint(['learner_id'], ['learners.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['module_id'], ['training_modules.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('learner_id', 'module_id')
    )
    op.create_table('knowledge_questions',
    sa.Column('module_id', sa.String(length=100), nullable=False),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('question', sa.Text(), nullable=False),
    sa.Column('choices', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('answer', sa.String(length=1), nullable=False),
    sa.CheckConstraint('number >= 1', name='knowledge_questions_number'),
    sa.CheckConstraint("answer IN ('A', 'B', 'C', 'D')", name='knowledge_questions_answer'),
    sa.CheckConstraint("jsonb_typeof(choices) = 'array'", name='knowledge_questions_choices'),
    sa.ForeignKeyConstraint(['module_id'], ['training_modules.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('module_id', 'number')
    )


def downgrade() -> None:
    op.drop_table('knowledge_questions')
    op.drop_table('training_progress')
    op.drop_table('training_modules')
    op.drop_index('uq_learners_email_lower', table_name='learners')
    op.drop_table('learners')
