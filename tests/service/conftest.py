import pytest
from tiny_models import make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint(arch, **kw) -> (directory, torch model); cached per session."""
    cache = {}

    def make(arch: str = "llama", **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"ckpt-{arch}")
            cache[key] = (str(d), make_checkpoint(d, arch, **kw))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoint):
    """(model, tokenizer) of the tiny Llama (8 heads, 4 kv heads) most engine and driver tests run."""
    import vsurge

    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    return vsurge.load_model(path)


# Real S3 / GCS / Hub servers on loopback for the model-source tests (tests/service/test_sources_*.py).
from sources_servers import gcs, gcs_server, hub, moto_server, s3, sharded_ckpt  # noqa: E402, F401


def pytest_terminal_summary(terminalreporter) -> None:
    """Say why the seed conformance tests did not run (no ../shared/seed beside the repository)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "no seed document" in str(r.longrepr)]
    if skipped:
        reason = str(skipped[0].longrepr[-1]) if isinstance(skipped[0].longrepr, tuple) else ""
        terminalreporter.write_line(f"{len(skipped)} seed conformance tests skipped: {reason}", yellow=True)
