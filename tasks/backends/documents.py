"""The document store searched by query_vector_db: PostgreSQL full-text ranking.

A small demo set is loaded on first use so a fresh system has something to find.
"""
from __future__ import annotations

from typing import Any

from sqlalchemy import func, literal_column, select
from sqlalchemy.dialects.postgresql import insert

from models import db
from models.documents import Document

DEMO_DOCUMENTS = [
    ("q3-sales-northwest", "Q3 sales report: Northwest region",
     "Northwest region Q3 sales totalled $4.2M across Washington, Oregon, Idaho and Montana; "
     "12,450 units sold, up 8% on Q2.", {"region": "northwest", "quarter": "Q3"}),
    ("q3-sales-southwest", "Q3 sales report: Southwest region",
     "Southwest region Q3 sales totalled $3.1M across Arizona, New Mexico and Nevada; 9,870 units sold.",
     {"region": "southwest", "quarter": "Q3"}),
    ("onboarding-guide", "Onboarding guide for new sales staff",
     "New sales staff complete product training, shadow two customer calls and pass the knowledge check "
     "in their first two weeks.", {"kind": "training"}),
    ("travel-policy", "Travel and expenses policy",
     "Book travel through the portal; meals up to $60 a day; submit receipts within 30 days.",
     {"kind": "policy"}),
]


def ensure_demo_documents() -> None:
    with db.session() as s:
        s.execute(
            insert(Document)
            .values([{"id": i, "title": t, "content": c, "doc_metadata": m} for i, t, c, m in DEMO_DOCUMENTS])
            .on_conflict_do_nothing(index_elements=["id"])
        )


def search(query: str, top_k: int = 5, filters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Rank documents against ``query``; ``filters`` match metadata keys exactly."""
    ensure_demo_documents()
    document = func.to_tsvector("english", Document.title + literal_column("' '") + Document.content)
    tsquery = func.websearch_to_tsquery("english", query)
    words = [w for w in query.lower().split() if w.isalnum()]
    loose = func.to_tsquery("english", " | ".join(words)) if words else tsquery
    score = func.ts_rank(document, loose)
    stmt = select(Document, score.label("score")).where(document.op("@@")(loose))
    for key, value in (filters or {}).items():
        if isinstance(value, (str, int, float, bool)):
            stmt = stmt.where(Document.doc_metadata[key].astext == str(value))
    stmt = stmt.order_by(score.desc(), Document.id).limit(top_k)
    with db.session() as s:
        rows = s.execute(stmt).all()
    return [
        {"id": doc.id, "title": doc.title, "snippet": doc.content[:200], "score": round(float(sc), 4),
         "metadata": doc.doc_metadata}
        for doc, sc in rows
    ]
