"""Shared, session-scoped fixtures: a tiny French corpus, tokenizer and shards.

The corpus manifest is built here from `tests/assets/tiny_fr.txt` without the ingest
module (so tokenizer and shard tests do not depend on it): one document per blank-line
separated paragraph, every 10th paragraph (index 9, 19, ...) in the validation split.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlm_pipeline.config import IngestConfig, ModelConfig, ShardConfig, TokenizerConfig
from mlm_pipeline.manifest import (
    CorpusManifest,
    ShardManifest,
    SourceEntry,
    TokenizerManifest,
    compute_digest,
    file_entry,
    sha256_file,
    write_manifest,
)
from mlm_pipeline.shards.parallel import available_cores

#: Most pytest-xdist workers `-n auto` starts (pyproject's addopts): each worker pays the
#: session's start-ups (collection, the tiny fixtures) once more, and the fast suite's
#: modules are too few and too uneven for more to help.
MAX_AUTO_WORKERS = 4


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown without it
def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for `-n auto`: the CPUs this process may use (its affinity, not the host's
    count a container shows), at most MAX_AUTO_WORKERS; `PYTEST_XDIST_AUTO_NUM_WORKERS`
    overrides. One CPU gives 0: no workers, the tests run in the pytest process."""
    if (forced := os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").strip()).isdigit():
        return int(forced)
    cpus = available_cores()
    return min(cpus, MAX_AUTO_WORKERS) if cpus > 1 else 0


#: Test modules that share one start-up per worker process: tests/flows/conftest.py's
#: Prefect test harness (a server subprocess and a fresh database: ~12 s of CPU to start).
HARNESS_MODULES = "tests/flows/"


def harness_unit_scheduling() -> type:
    """pytest-xdist's `loadfile` scheduling class (each module is a unit, run by one worker)
    with the modules under `HARNESS_MODULES` as one unit.

    `_split_scope` (a test's unit) is pytest-xdist's override point: private, but the one
    its own `loadfile` and `loadgroup` use; tests/unit/test_xdist_scheduling.py fails if an
    upgrade stops calling it. (Imported here: pytest-xdist is a dev dependency.)
    """
    from xdist.scheduler import LoadFileScheduling

    class HarnessUnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(HARNESS_MODULES):
                return HARNESS_MODULES
            return super()._split_scope(nodeid)

    return HarnessUnitScheduling


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown without it
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (pyproject's addopts), except that when slow tests are deselected
    (the fast suite) the modules under `HARNESS_MODULES` are one unit, run by one worker
    (`harness_unit_scheduling`): one Prefect test harness for the suite instead of one per
    worker. The slow tiers keep whole modules as units (`--no-loadscope-reorder` orders
    them, longest first)."""
    if config.getvalue("dist") != "loadfile" or "not slow" not in (config.option.markexpr or ""):
        return None
    return harness_unit_scheduling()(config, log)


def _share_the_cpus_between_workers() -> None:
    """Under pytest-xdist, give each worker's torch (and the processes it starts) its share
    of the CPUs, so that N workers do not run N x CPUs threads: oversubscribed OpenMP
    threads spin against each other, and small ops get slower, not faster. A thread count
    the caller set (`OMP_NUM_THREADS`) is kept. Runs when this conftest is imported, before
    any test module imports torch (nothing this conftest imports does)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, available_cores() // workers))


_share_the_cpus_between_workers()


ASSETS = Path(__file__).parent / "assets"
TINY_FR = ASSETS / "tiny_fr.txt"


def read_tiny_paragraphs() -> list[str]:
    """The paragraphs of `tiny_fr.txt`, NFC-normalized, in file order."""
    text = TINY_FR.read_text(encoding="utf-8")
    return [unicodedata.normalize("NFC", p.strip()) for p in text.split("\n\n") if p.strip()]


def build_corpus_manifest(out_dir: Path, paragraphs: list[str]) -> CorpusManifest:
    """Write `paragraphs` as a two-split Parquet corpus in `out_dir` and its manifest.

    Every 10th paragraph (index % 10 == 9) goes to validation, the rest to train.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "validation": []}
    for i, text in enumerate(paragraphs):
        splits["validation" if i % 10 == 9 else "train"].append((f"tiny_fr.txt:{i}", text))
    entries = {}
    for name, docs in splits.items():
        path = out_dir / f"{name}-00000.parquet"
        table = pa.table(
            {
                "id": [d[0] for d in docs],
                "text": [d[1] for d in docs],
                "source": [str(TINY_FR)] * len(docs),
            }
        )
        pq.write_table(table, path)
        entries[name] = [file_entry(out_dir, path, rows=len(docs))]
    source_sha = sha256_file(TINY_FR)
    cfg = IngestConfig(sources=[str(TINY_FR)], validation_fraction=0.1)
    inputs = {str(TINY_FR): source_sha, "paragraphs": compute_digest("raw", paragraphs, {})}
    manifest = CorpusManifest(
        stage="ingest",
        digest=compute_digest("ingest", cfg, inputs),
        output_dir=str(out_dir.resolve()),
        config=cfg.model_dump(mode="json"),
        inputs=inputs,
        created_at=0.0,
        wall_time_s=0.0,
        sources=[
            SourceEntry(
                path=str(TINY_FR),
                sha256=source_sha,
                bytes=TINY_FR.stat().st_size,
                documents=len(paragraphs),
            )
        ],
        train=entries["train"],
        validation=entries["validation"],
        documents_read=len(paragraphs),
        documents_kept=len(paragraphs),
        documents_train=len(splits["train"]),
        documents_validation=len(splits["validation"]),
        characters=sum(len(p) for p in paragraphs),
        dropped={},
        repaired={},
    )
    write_manifest(manifest)
    return manifest


@pytest.fixture(scope="session")
def tiny_paragraphs() -> list[str]:
    """The documents of `tiny_fr.txt` (NFC paragraphs), in order."""
    return read_tiny_paragraphs()


@pytest.fixture(scope="session")
def make_corpus_manifest():
    """`build_corpus_manifest(out_dir, paragraphs)`: a corpus of your own paragraphs."""
    return build_corpus_manifest


@pytest.fixture(scope="session")
def tiny_work_dir(tmp_path_factory) -> Path:
    """A session-wide pipeline work directory for the tiny fixtures."""
    return tmp_path_factory.mktemp("work")


@pytest.fixture(scope="session")
def tiny_corpus_manifest(tmp_path_factory) -> CorpusManifest:
    """`tiny_fr.txt` as an ingested corpus (about 23 train and 2 validation documents)."""
    return build_corpus_manifest(tmp_path_factory.mktemp("corpus"), read_tiny_paragraphs())


@pytest.fixture(scope="session")
def tiny_tokenizer_config() -> TokenizerConfig:
    """Unigram, vocab_size 128."""
    return TokenizerConfig(vocab_size=128)


@pytest.fixture(scope="session")
def tiny_tokenizer_manifest(
    tiny_tokenizer_config, tiny_corpus_manifest, tiny_work_dir
) -> TokenizerManifest:
    """A SentencePiece unigram model with 128 pieces trained on the tiny corpus."""
    from mlm_pipeline.tokenizer.stage import train_tokenizer

    return train_tokenizer(tiny_tokenizer_config, tiny_corpus_manifest, tiny_work_dir)


@pytest.fixture(scope="session")
def tiny_shard_config() -> ShardConfig:
    """seq_len 16; small shards and encode batches so that both boundaries are crossed."""
    return ShardConfig(seq_len=16, rows_per_shard=64, encode_batch_size=4)


@pytest.fixture(scope="session")
def tiny_shard_manifest(
    tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_work_dir
) -> ShardManifest:
    """Packed rows of 16 tokens of the tiny corpus (several train shards, one validation)."""
    from mlm_pipeline.shards.stage import write_shards

    return write_shards(
        tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_work_dir
    )


@pytest.fixture(scope="session")
def tiny_model_config() -> ModelConfig:
    """hidden 32, 2 layers, 2 heads, feed-forward 64, no dropout."""
    return ModelConfig(
        hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, dropout=0.0
    )


def reference_reservoir_sample(items: list, k: int, seed: int) -> list:
    """Algorithm R (Vitter 1985) as `documents.write_training_text` documents it, one item
    at a time: item t >= k draws j = min(floor(u * (t + 1)), t), u = (x >> 11) * 2**-53,
    x the next raw output of numpy's PCG64(seed); the kept items in input order."""
    import math

    import numpy as np

    bits = np.random.PCG64(seed)
    slots = list(range(min(k, len(items))))
    for t in range(k, len(items)):
        u = (int(bits.random_raw()) >> 11) * 2.0**-53
        if (j := min(math.floor(u * (t + 1)), t)) < k:
            slots[j] = t
    return [items[i] for i in sorted(slots)]


@pytest.fixture(scope="session")
def reservoir_sample():
    """`reference_reservoir_sample(items, k, seed)`: the training-text sample, computed
    independently of the module."""
    return reference_reservoir_sample


# --- Tiers: the slow suite's `full` tier runs one slice per landing ---------------------

FULL_MARKER = "full"

#: Estimated seconds of each module's `full` tests on two cores (their module fixtures
#: included), which balance the slices; update them from the durations CI prints. A module
#: not listed counts DEFAULT_FULL_COST_S.
FULL_COST_S = {
    # measured (CI, 2 bf16 cores, 2026-12-03, beside the README test on the other worker)
    "tests/flows/test_resume_cli.py": 290,
    "tests/integration/test_registry_walkthrough.py": 120,
    "tests/flows/test_interrupt_pipe.py": 75,
    "tests/integration/test_train_features.py": 70,
    "tests/flows/test_distributed_flow.py": 56,
    "tests/integration/test_registry_holdout.py": 16,
    "tests/integration/test_linear_probe.py": 2,
    "tests/integration/test_warm_start_mlflow.py": 1,
    # measured (CI, 2 cores, alone; busy machine at 50 steps on bf16 cores)
    "tests/flows/test_busy_machine.py": 170,
    "tests/flows/test_s3_work_dir.py": 120,
    "tests/integration/test_distributed.py": 50,
    "tests/integration/test_runs_compare.py": 45,
    "tests/integration/test_compile_recompiles.py": 40,
    "tests/flows/test_dask_prep.py": 20,
    "tests/flows/test_lineage_flow.py": 15,
    "tests/flows/test_warm_start_flow.py": 10,
    "tests/integration/test_checkpoint_verified.py": 6,
    # estimated
    "tests/deploy/test_deployments.py": 300,
    "tests/flows/test_concurrent_cli.py": 150,
    "tests/packaging/test_wheel.py": 180,
    "tests/packaging/test_floors.py": 100,  # measured locally: 95 s (uv install warm cache)
    "tests/integration/test_debian_fetch.py": 120,
    "tests/integration/test_warm_start.py": 70,
    "tests/integration/test_registry.py": 120,
}
DEFAULT_FULL_COST_S = 60

#: Estimated seconds of each module's push-tier tests (slow, not `full`) on two cores. With
#: FULL_COST_S it orders the slow modules longest first, so that the pytest-xdist worker
#: that finishes first takes the short ones and neither waits on the other at the end.
PUSH_COST_S = {
    # measured (CI, 2 bf16 cores, 2026-12-03, on two workers)
    "tests/readme/test_quickstart.py": 850,
    "tests/deploy/test_deployments.py": 110,
    "tests/flows/test_concurrent_cli.py": 100,
    "tests/flows/test_resume_cli.py": 90,
    "tests/integration/test_benchmarks_smoke.py": 60,
    "tests/integration/test_cli_errors.py": 30,
    "tests/flows/test_distributed_flow.py": 27,
    "tests/flows/test_assets.py": 6,
    "tests/integration/test_bench_learning_steps.py": 1,
    # measured (alone in the fast suite, on two workers, 2026-12-03), with a margin
    "tests/flows/test_dask_prep.py": 20,
    "tests/flows/test_local_api.py": 20,
    "tests/integration/test_registry.py": 15,
}


def pytest_addoption(parser):
    parser.addoption(
        "--slice", metavar="K/N", default=None,
        help="keep slice K of N (1-based) of the selected tests marked `full` and deselect "
             "the other full tests (tests without the mark are kept). A module's full tests "
             "stay in one slice; modules are spread by estimated cost (tests/conftest.py).")


def parse_slice(text: str) -> tuple[int, int]:
    """`"K/N"` -> (K, N), 1 <= K <= N.

    Raises:
        pytest.UsageError: not two integers `K/N` with 1 <= K <= N.
    """
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--slice: expected K/N (e.g. 2/3), got {text!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--slice: K must be in 1..N, got {text!r}")
    return k, n


def assign_slices(modules: list[str], n: int, cost_s: dict[str, float],
                  default_s: float) -> dict[str, int]:
    """Module path -> slice (1..n): the costliest module first (ties by path), each to the
    slice with the least estimated seconds so far (ties to the lowest slice number).

    A module stays whole, so its module-scoped fixtures (servers, reference runs) start in
    one slice only. Depends only on the module paths and the costs: stable across runs.
    """
    load = [0.0] * n
    out = {}
    for module in sorted(modules, key=lambda m: (-cost_s.get(m, default_s), m)):
        k = min(range(n), key=lambda i: (load[i], i))
        load[k] += cost_s.get(module, default_s)
        out[module] = k + 1
    return out


_SLICE_KEY = pytest.StashKey[tuple]()


def longest_modules_first(items: list) -> None:
    """Sort `items` in place: the modules of slow tests by descending estimated seconds
    (PUSH_COST_S if the module's push-tier tests are among `items`, plus FULL_COST_S if
    its `full` tests are), the other tests after them as collected (stable)."""
    def module(item) -> str:
        return item.nodeid.split("::", 1)[0]

    cost: dict[str, float] = {}
    for name, full in {(module(item), bool(item.get_closest_marker(FULL_MARKER)))
                       for item in items if item.get_closest_marker("slow")}:
        cost[name] = cost.get(name, 0.0) + (FULL_COST_S.get(name, DEFAULT_FULL_COST_S)
                                            if full else PUSH_COST_S.get(name, 0.0))
    items.sort(key=lambda item: -cost[module(item)] if item.get_closest_marker("slow")
               else 1.0)


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselected: slices of what is selected
def pytest_collection_modifyitems(config, items):
    text = config.getoption("--slice")
    full = [item for item in items if item.get_closest_marker(FULL_MARKER)]
    if text is not None and full:
        k, n = parse_slice(text)
        modules = sorted({item.nodeid.split("::", 1)[0] for item in full})
        slices = assign_slices(modules, n, FULL_COST_S, DEFAULT_FULL_COST_S)
        dropped = [item for item in full if slices[item.nodeid.split("::", 1)[0]] != k]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            gone = set(map(id, dropped))
            items[:] = [item for item in items if id(item) not in gone]
        kept = [m for m in modules if slices[m] == k]
        config.stash[_SLICE_KEY] = (k, n, len(full) - len(dropped), len(full), kept)
    # Under pytest-xdist with `--dist loadfile --no-loadscope-reorder` (.ci/run) a worker
    # takes whole modules in this order: the README test's one long run starts at once on
    # one worker while the other works through the rest, and the short modules come last.
    longest_modules_first(items)


def pytest_report_collectionfinish(config, start_path, items):
    if (found := config.stash.get(_SLICE_KEY, None)) is not None:
        k, n, kept, total, modules = found
        return f"full tier: slice {k}/{n}, {kept} of {total} full tests: {', '.join(modules)}"
    return None


# --- Where the time went: lines tests record, printed at the end ---------------------------

#: `record_property` name of a line the session prints in its summary (for CI's account of
#: where its time goes, e.g. the README test's install and run); on pytest-xdist the
#: workers' reports carry it to the controller, which prints it.
TIMING_PROPERTY = "timing"
_TIMINGS: list[str] = []


def pytest_runtest_logreport(report):
    _TIMINGS.extend(value for name, value in getattr(report, "user_properties", ())
                    if name == TIMING_PROPERTY and report.when == "call")


def pytest_terminal_summary(terminalreporter):
    if _TIMINGS:
        terminalreporter.section("timings")
        for line in _TIMINGS:
            terminalreporter.write_line(line)


# --- Start-ups paid once per session -------------------------------------------------------


@pytest.fixture(scope="session")
def prefect_api_url(tmp_path_factory):
    """`PREFECT_API_URL` of one `prefect server start` on loopback for the whole session.

    For `mlm-pipeline run` processes in tests that are not about the local API the CLI
    starts itself: with it set, a run skips that start (and its database migrations).
    Started on first use; stopped at the end of the session, also on failure.
    """
    from tests.servers import start_prefect_server, stop

    url, proc = start_prefect_server(tmp_path_factory.mktemp("prefect-server"))
    try:
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def fresh_mlflow_db(tmp_path_factory):
    """`fresh_mlflow_db(path) -> tracking URI`: an empty MLflow SQLite store at `path`.

    The store's migrations run once per session in a template that is copied to `path`,
    so a test whose runs each need their own store does not pay them each time.
    """
    import shutil
    import subprocess
    import sys

    folder = tmp_path_factory.mktemp("mlflow-template")
    template = folder / "mlflow.db"
    # In a child whose working directory is the template's folder: the store records the
    # Default experiment's artifact location under it (never under the checkout).
    subprocess.run(
        [sys.executable, "-c", "import sys; from mlflow.tracking import MlflowClient; "
         "MlflowClient(tracking_uri=sys.argv[1]).search_experiments()",
         f"sqlite:///{template}"], cwd=folder, check=True, capture_output=True, timeout=300)

    def make(path: Path) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, path)
        return f"sqlite:///{path}"

    return make


@pytest.fixture(scope="session")
def debian_tiny_data(tmp_path_factory):
    """The `tiny` config's ingest (the real `debian:fr` corpus) and tokenizer (unigram
    8,000) stages, run once per session: (work directory, CorpusManifest,
    TokenizerManifest).

    Tests read the manifests, or copy the work directory (`shutil.copytree`) and give the
    copy as `work_dir` to a run, which then reuses both stages. Skipped off Debian (the
    corpus comes from Debian packages).
    """
    import shutil

    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        pytest.skip("not a Debian system: the default corpus comes from Debian packages")
    from mlm_pipeline.config_files import load_config
    from mlm_pipeline.ingest import ingest
    from mlm_pipeline.tokenizer import train_tokenizer

    cfg = load_config("tiny")
    work = tmp_path_factory.mktemp("debian-tiny") / "work"
    corpus = ingest(cfg.ingest, work)
    return work, corpus, train_tokenizer(cfg.tokenizer, corpus, work)
