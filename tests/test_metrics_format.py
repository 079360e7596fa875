"""The metrics pages as Prometheus reads them (docs/operations.md, Metrics).

Prometheus 2.42 logs ``mime: duplicate parameter name`` for a ``Content-Type`` that names a
parameter twice, and Prometheus 3 fails the scrape. Each page's header is parsed as MIME
(``email.message``) and must be exactly the text format 0.0.4's; its body is parsed by
``prometheus_client.parser`` and, where the Debian package is installed, by ``promtool check metrics``.
"""
from __future__ import annotations

import email.message
import shutil
import subprocess
from pathlib import Path

import pytest
import requests
from prometheus_client import start_http_server
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import AUTH

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # what Prometheus 2.42 sends when it scrapes


def parameters(content_type: str) -> list[str]:
    """The parameter names of a Content-Type header, in order (the media type first), as MIME reads them."""
    message = email.message.Message()
    message["Content-Type"] = content_type
    return [name.lower() for name, _ in message.get_params()]


def check_page(content_type: str, body: str) -> list:
    names = parameters(content_type)
    assert len(names) == len(set(names)), f"a parameter named twice: {content_type!r}"
    assert content_type == PROMETHEUS_TEXT == CONTENT_TYPE_PLAIN_0_0_4
    families = list(text_string_to_metric_families(body))
    assert families
    return families


def promtool(body: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True, timeout=60)


def test_the_parameter_reading_sees_a_duplicate():
    assert parameters("text/plain; version=0.0.4; charset=utf-8; charset=utf-8").count("charset") == 2


def test_the_api_metrics_page_has_prometheus_text_content_type_once(client):
    client.get("/voice-tools/status/tc_nothing", headers=AUTH)
    answer = client.get("/metrics", headers=AUTH)
    assert answer.status_code == 200
    families = check_page(answer.headers["Content-Type"], answer.get_data(as_text=True))
    assert "voice_tools_http_requests" in {family.name for family in families}


@pytest.fixture
def workers_page(tmp_path: Path, celery_app_instance):
    """The workers' page (``tasks/worker/metrics_page.py``) served as ``voice-tools worker-metrics`` serves it."""
    from support.procs import free_port
    from tasks.worker import metrics_page

    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1",
                                       registry=metrics_page.registry(tmp_path, celery_app_instance))
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_workers_metrics_page_has_prometheus_text_content_type_once(workers_page):
    answer = requests.get(workers_page, timeout=10)
    assert answer.status_code == 200
    families = check_page(answer.headers["Content-Type"], answer.text)
    assert {"voice_tools_queue_depth", "voice_tools_calls"} <= {family.name for family in families}


def test_the_workers_page_answers_prometheus_own_accept_header_with_one_of_each_parameter(workers_page):
    """Prometheus asks for OpenMetrics first; prometheus-client's negotiation answers it, named once each."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

    answer = requests.get(workers_page, timeout=10, headers={"Accept": PROMETHEUS_ACCEPT})
    names = parameters(answer.headers["Content-Type"])
    assert names[0] == "application/openmetrics-text" and len(names) == len(set(names)), answer.headers
    assert "voice_tools_queue_depth" in {family.name for family in openmetrics_families(answer.text)}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_promtool_accepts_both_pages(client, workers_page):
    client.get("/voice-tools/status/tc_nothing", headers=AUTH)
    for body in (client.get("/metrics", headers=AUTH).get_data(as_text=True),
                 requests.get(workers_page, timeout=10).text):
        checked = promtool(body)
        assert checked.returncode == 0, checked.stdout + checked.stderr
