"""Shared test setup: GPU-marked tests skip on machines without CUDA; the longest modules run first."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

# The modules that take longest (wall seconds at `-n 4 --dist loadscope` on the 2-core CI machine,
# measured 2026-11-26), in the order xdist hands them out (--no-loadscope-reorder in pyproject.toml):
# each worker starts with two (scopes i and i+4 of this order), then takes the next free one. The
# first four pair the two that mostly wait (the fault tests' kills and restarts, Slurm's scheduler)
# with the two longest CPU-bound ones, so the cores are busy from the start (four waiting modules
# first left ~0.4 of a core idle for ~100 s); the mixed ones (nodes, trackers) come second. A module
# not listed runs after these, in the usual order.
LONGEST_FIRST = (
    "integration/test_faults.py",  # ~105 s, waits for kills, restarts, a hang's timeout
    "integration/test_slurm.py",  # ~110 s, waits for Slurm's scheduler
    "integration/test_clients.py",  # one 14-job sweep: ~115 s
    # ~100 documented commands in one worker (~140 s at -n 4); listed nowhere, it started last and
    # ran alone at the end (2026-11-25: 533 s CI)
    "integration/test_docs.py",
    "integration/test_multinode_private.py",
    "integration/test_observe.py",
    "integration/test_data_streams.py",  # two sweeps (7 + 7 jobs) and a kill run: ~80 s at -n 4
    "integration/test_engine_depth.py",
    "integration/test_multinode.py",
    "integration/test_init_export.py",  # two sweeps (2 + 6 jobs)
    "unit/test_cli.py",
    "unit/test_config.py",
    "integration/test_resume.py",
    "integration/test_strategies_dp.py",
    "integration/test_user_code.py",
    "integration/test_tools.py",
    "integration/test_strategies_mp.py",
    "integration/test_k8s_pods.py",
    "integration/test_error_report.py",
    "unit/test_config_instantiate.py",
    "integration/test_train_e2e.py",
    "integration/test_parity.py",
)


def _rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith(name)), len(LONGEST_FIRST))


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker computes on one intra-op thread: the README's four workers share two cores,
    and torch's default (a thread per core) in each would oversubscribe them (the checks' dry steps
    and the in-process runs' parents compute here; a rank sets its own count, threads_per_rank)."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    items.sort(key=_rank)  # stable: each module's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-compatible server on 127.0.0.1 (moto's server mode, as s3fs tests itself): the
    tests reach it over HTTP through s3fs and botocore, never a mocked client. One per session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    """A GCS JSON API server on 127.0.0.1 (gcp-storage-emulator, in this process), for gs:// through
    gcsfs over HTTP. Two gaps of the emulator filled here: objects.move (gcsfs renames with it, and
    retries a 501 for ~30 s before it copies instead), as copy then delete; and gcsfs's bucket-type
    lookup (a gRPC call the emulator does not serve, 60 s of retries per bucket) is turned off by
    gcsfs's own switch, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false, read when gcsfs is first imported."""
    import os
    import socket
    from http import HTTPStatus

    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before gcsfs's first import
    from gcp_storage_emulator import server as emulator
    from gcp_storage_emulator.handlers import objects

    def move(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
        request.params["dest_bucket_name"] = request.params["bucket_name"]
        objects.copy(request, response, storage)
        if response.status == HTTPStatus.OK:
            objects._delete(storage, request.params["bucket_name"], request.params["object_id"])

    route = r"^/storage/v1/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$"
    emulator.HANDLERS = ((route, {emulator.POST: move}), *emulator.HANDLERS)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = emulator.create_server("127.0.0.1", port, in_memory=True)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def gs_bucket(gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """`gs://<a new bucket>` on the session's GCS server: STORAGE_EMULATOR_HOST (gcsfs's standard
    variable for an emulator) and anonymous access through fsspec's per-protocol defaults."""
    import uuid

    import fsspec.config

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    monkeypatch.setattr(fsspec.config, "conf", {"gs": {"token": "anon", "project": "test"}})
    from disttrain.storage import filesystem

    name = f"bkt-{uuid.uuid4().hex[:12]}"
    filesystem("gs://x", fresh=True).mkdir(name)
    return f"gs://{name}"


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture
def s3_bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """`s3://<a new bucket>` on the session's server, reached the standard way: AWS_ENDPOINT_URL and
    credentials in the environment (which the ranks a test starts inherit)."""
    import uuid

    import s3fs
    from shared_support import S3_ENV

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    name = f"bkt-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(name)
    return f"s3://{name}"
