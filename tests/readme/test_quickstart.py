"""The README's Quickstart as a new user meets it.

Command 1 (set up and run the main job) is read from README.md itself (the first ```bash
block under "## Quickstart", the line after the comment "# 1.") and run verbatim with
`bash -c` (after `set -x`, for the timings) in a fresh `git clone` of this checkout's
committed HEAD (uncommitted changes are not tested), with a fresh virtual environment
first on PATH, an empty HOME and none of the project's environment variables: the
default local Prefect API and the SQLite MLflow database `mlflow.db` in the clone. pip
keeps this machine's indexes and cache (the `PIP_*` variables, `pip cache dir`, and the
pip config files `pip config debug` lists, copied into one `PIP_CONFIG_FILE`, since the
user's own file lies in the real HOME), and does not compile to bytecode what it installs
(`PIP_COMPILE=0`, about half of the install's time: the run compiles what it imports). On
a pytest-xdist worker the run keeps the worker's share of the cores (`OMP_NUM_THREADS`,
tests/conftest.py), as on a machine with that many: CI runs it on one of two workers while
the other runs the rest of the slow tests.

One run serves every slow test here: the README's figures, the MLflow run, the registry,
and the checks on the data, the validation curve and the probes. Measured on 2 idle cores of
an AMD EPYC without bf16 (fp32): about 2 minutes of install with a warm pip cache, then
about 1 step/s (2,000 tokens/s), some 20 minutes for the whole run; with bf16 (AMD EPYC
Zen 4) install and run took 568-612 s on both cores, 740-861 s on one core beside CI's
other slow tests. Command 2 (set up and run the tests) is not run again: a fast
test checks that it is the test command CI runs.

Needs `git`, the package indexes pip is configured with, and the Debian archive
(`apt-get download`) for the default corpus.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from tests.conftest import TIMING_PROPERTY

ROOT = Path(__file__).resolve().parents[2]
#: What the shipped `tiny` config asks for, read from the YAML itself (not through the
#: package's config loader): the steps and the periodic evaluation's interval.
TINY = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text(encoding="utf-8"))
MAX_STEPS = TINY["train"]["max_steps"]
EVERY = TINY["eval"]["every_steps"]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
#: `eval/mlm_accuracy` may differ from the README's "about X" by this much: the README
#: gives two decimals, measured with bf16 autocast (CPUs with native bf16); a CPU without
#: it trains in fp32, whose rounding differs (the run reports `precision`).
ACCURACY_TOLERANCE = 0.03
#: Seconds command 1 may take (install and run; about 10 minutes on 2 idle cores).
RUN_TIMEOUT_S = 3300
#: Environment variables a fresh machine does not have: the project's and its tools'
#: settings (a tracking server, a Prefect API, a work directory, credentials) and the outer
#: interpreter's, and the thread count pytest-xdist workers set for their own tests
#: (tests/conftest.py; kept on a pytest-xdist worker, see `fresh_environment`). The opt-outs
#: of telemetry are kept (they change no result).
DROPPED_PREFIXES = ("PREFECT_", "MLFLOW_", "MLM_PIPELINE", "FSSPEC_", "AWS_", "HF_",
                    "TRANSFORMERS_", "PYTHON", "VIRTUAL_ENV", "CONDA_", "PIP_CONFIG_FILE",
                    "OMP_NUM_THREADS", "PYTEST_XDIST")
KEPT = {"PREFECT_SERVER_ANALYTICS_ENABLED", "MLFLOW_DISABLE_TELEMETRY"}
#: pip's retries per URL (its default is 5, with a growing back-off). CI machines reach the
#: package registries only: the README's `--extra-index-url https://download.pytorch.org/...`
#: cannot be resolved there, and five retries with back-off for each of torch's
#: dependencies cost minutes of the Quickstart's install for nothing. A user's machine
#: reaches the index; pip's retry count changes which host answers, never what is installed.
PIP_RETRIES = 1


def quickstart_block(readme: Path = README) -> str:
    """The first ```bash block under the README's "## Quickstart" heading."""
    text = readme.read_text(encoding="utf-8")
    section = text.split("\n## Quickstart", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert match, "README.md: no ```bash block under ## Quickstart"
    return match.group(1)


def quickstart_command(number: int, readme: Path = README) -> str:
    """The command line after the comment `# N.` (its continuation comment lines skipped)."""
    lines = quickstart_block(readme).splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(f"# {number}.")]
    assert starts, f"README.md Quickstart: no comment '# {number}.'"
    for line in lines[starts[0] + 1:]:
        if line.strip() and not line.lstrip().startswith("#"):
            return line.strip()
    raise AssertionError(f"README.md Quickstart: no command after '# {number}.'")


def readme_accuracy() -> tuple[float, float]:
    """The README's stated `tiny` figures: held-out masked-token accuracy ("about X") and
    the most-frequent-token baseline ("gives Y")."""
    text = " ".join(README.read_text(encoding="utf-8").split())
    match = re.search(r"accuracy of about (0\.\d+) \(`eval/mlm_accuracy`; always predicting "
                      r"the most frequent token gives (0\.\d+)\)", text)
    assert match, "README.md: the stated eval/mlm_accuracy of the tiny run is not found"
    return float(match.group(1)), float(match.group(2))


def _pip_config_file(dest: Path) -> Path:
    """One pip config file merging those `pip config debug` lists as existing (global,
    user, site, then the file `PIP_CONFIG_FILE` names), in pip's order of precedence."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "debug"], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    found: dict[str, list[str]] = {}
    variant = ""
    for line in out.splitlines():
        if re.fullmatch(r"\w+:", line.strip()) and not line.startswith(" "):
            variant = line.strip()[:-1]
        match = re.fullmatch(r"\s+(\S.*), exists: True", line)
        if match:
            found.setdefault(variant, []).append(match.group(1))
    merged = configparser.RawConfigParser()
    for variant in ("global", "user", "site", "env"):
        for path in found.get(variant, []):
            merged.read(path, encoding="utf-8")
    with dest.open("w", encoding="utf-8") as f:
        merged.write(f)
    return dest


def fresh_environment(home: Path, venv: Path, tmp: Path) -> dict[str, str]:
    """The environment of a fresh machine with this machine's package indexes and cache."""
    env = {k: v for k, v in os.environ.items()
           if k in KEPT or not k.startswith(DROPPED_PREFIXES)}
    cache = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True,
                           text=True, check=False, timeout=60).stdout.strip()
    if cache:  # empty when the outer pip runs with its cache disabled
        env["PIP_CACHE_DIR"] = cache
    # the test's own environment's bin (an activated venv) is no part of a fresh machine
    outer_bin = str(Path(sys.prefix) / "bin")
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != outer_bin]
    env.update(HOME=str(home), PATH=os.pathsep.join([str(venv / "bin"), *path]),
               PIP_CONFIG_FILE=str(_pip_config_file(tmp / "pip.conf")),
               PIP_RETRIES=str(PIP_RETRIES), PIP_COMPILE="0")
    if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]  # the worker's share
    return env


def slow(test):
    """Slow, with room for the module's one run (install and training, about 10 minutes on
    2 cores) in the timeout of the first test that needs it."""
    return pytest.mark.slow(pytest.mark.timeout(3600)(test))


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> dict:
    """Command 1 run once: its exit code, output, wall times, summary and MLflow client."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.fail("the Quickstart test clones the checkout: it needs git and a git checkout")
    tmp = tmp_path_factory.mktemp("quickstart")
    clone, home, venv = tmp / "clone", tmp / "home", tmp / "venv"
    home.mkdir()
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True,
                            text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    command = quickstart_command(1, clone / "README.md")  # the committed README's
    env = fresh_environment(home, venv, tmp)
    started = time.time()
    # bash traces each command of the line with a timestamp (install vs run); PS4 is set
    # in the script because bash run as root ignores a PS4 from the environment.
    argv = ["bash", "-c", f"PS4='+[$EPOCHREALTIME] '\nset -x\n{command}"]
    try:
        proc = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:  # keep what it printed: how far it got
        def text(out: str | bytes | None) -> str:
            return out.decode(errors="replace") if isinstance(out, bytes) else out or ""
        proc = subprocess.CompletedProcess(argv, f"killed after {RUN_TIMEOUT_S} s",
                                           text(exc.stdout), text(exc.stderr))
    ended = time.time()
    # bash's trace line of the `mlm-pipeline` command marks the end of the installs.
    traced = re.search(r"^\+\[(\d+\.\d+)\] mlm-pipeline ", proc.stderr, re.MULTILINE)
    run_start = float(traced.group(1)) if traced else ended
    summary_path = clone / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    from mlflow.tracking import MlflowClient
    result = {
        "command": command, "commit": commit, "clone": clone, "proc": proc,
        "install_s": run_start - started, "run_s": ended - run_start, "summary": summary,
        "threads": env.get("OMP_NUM_THREADS"),
        "client": MlflowClient(tracking_uri=f"sqlite:///{clone}/mlflow.db"),
    }
    metrics = summary["metrics"] if summary else {}
    print(f"\nREADME command 1 at {commit[:12]}: {command}\n"
          f"exit code {proc.returncode}; install {result['install_s']:.0f} s, "
          f"run {result['run_s']:.0f} s; device {summary and summary.get('device')}, "
          f"precision {summary and summary.get('precision')}")
    for key in sorted(metrics):
        print(f"  {key} = {metrics[key]}")
    return result


def _ok(quickstart) -> dict:
    proc = quickstart["proc"]
    assert proc.returncode == 0, (f"README command 1 exited {proc.returncode}:\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    assert quickstart["summary"] is not None, "summary.json was not written"
    return quickstart["summary"]


def _rows(manifest: dict, split: str) -> np.ndarray:
    """Token rows of a shard split read with plain pyarrow (not the project's reader)."""
    out = []
    for shard in manifest[split]["shards"]:
        with pa.memory_map(str(Path(manifest["output_dir"]) / shard["path"])) as src:
            table = pa.ipc.open_file(src).read_all()
        out.append(np.stack(table.column("input_ids").to_pylist()))
    return np.concatenate(out)


# --- command 1: exit status, printed summary, the README's figures


@slow
def test_command_1_exits_0_and_prints_the_run_and_metrics(quickstart, record_property):
    threads = quickstart["threads"] or "all"
    record_property(TIMING_PROPERTY, f"README command 1: install {quickstart['install_s']:.0f} "
                                     f"s, run {quickstart['run_s']:.0f} s (threads: {threads})")
    summary = _ok(quickstart)
    out = quickstart["proc"].stdout
    assert summary["mlflow_run_id"] in out
    assert "eval/mlm_accuracy" in out
    assert (quickstart["clone"] / "mlflow.db").is_file()
    # Third-party noise stays in the log file; no link to the temporary Prefect server.
    both = out + quickstart["proc"].stderr
    for noise in ("View at http", "Skip logging GPU metrics", "Loading weights",
                  "Writing model shards"):
        assert noise not in both, noise
    assert "a temporary local server for this command only" in both


@slow
def test_accuracy_is_the_readme_figure(quickstart):
    summary = _ok(quickstart)
    stated, stated_baseline = readme_accuracy()
    metrics = summary["metrics"]
    assert metrics["eval/mlm_accuracy"] == pytest.approx(stated, abs=ACCURACY_TOLERANCE), (
        f"precision {summary.get('precision')}")
    # the baseline depends on the data only (not on training or precision)
    assert metrics["eval/baseline_accuracy"] == pytest.approx(stated_baseline, abs=0.0015)


@slow
def test_every_step_of_the_config_was_trained(quickstart):
    summary = _ok(quickstart)
    client = quickstart["client"]
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["train.max_steps"] == str(MAX_STEPS)
    assert summary["steps"] == MAX_STEPS and summary["stop_reason"] == "max_steps"
    assert run.data.tags.get("mlm.stop_reason") != "time_cap"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert max(steps) == MAX_STEPS


# --- the MLflow run and the registry (sqlite:///<clone>/mlflow.db)


@slow
def test_mlflow_run_finished_with_params_and_artifacts(quickstart):
    summary = _ok(quickstart)
    client = quickstart["client"]
    r = client.get_run(summary["mlflow_run_id"])
    assert r.info.status == "FINISHED"
    assert r.data.params["ingest.sources"] == "debian:fr"
    corpus = json.loads(Path(summary["manifests"]["ingest"]).read_text())
    assert int(r.data.params["data.documents_read"]) == corpus["documents_read"] > 1000
    tops = {a.path for a in client.list_artifacts(r.info.run_id)}
    # the resumable training state stays local (tracking.log_training_state is off);
    # the model leaves as the run's MLflow model, registered
    assert {"tokenizer", "manifests", "eval", "train"} <= tops
    assert "checkpoints" not in tops
    losses = [m.value for m in client.get_metric_history(r.info.run_id, "train/loss")]
    tenth = max(1, len(losses) // 10)
    assert np.mean(losses[-tenth:]) < np.mean(losses[:tenth])


@slow
def test_model_is_registered_as_champion(quickstart):
    summary = _ok(quickstart)
    client = quickstart["client"]
    run = client.get_run(summary["mlflow_run_id"])
    # a fresh clone has no registry yet: the first version becomes the champion
    assert run.data.tags["registry.decision"] == "first"
    (model,) = client.search_registered_models()
    champion = client.get_model_version_by_alias(model.name, "champion")
    assert champion.run_id == summary["mlflow_run_id"]
    assert summary["registry"]["model"] == model.name
    assert str(summary["registry"]["champion_version"]) == str(champion.version)


# --- what the run computed, checked against values computed here


@slow
def test_accuracy_beats_the_most_frequent_token(quickstart):
    import torch

    from mlm_pipeline.masking.keyed import mask_tokens

    summary = _ok(quickstart)
    client = quickstart["client"]
    metrics = client.get_run(summary["mlflow_run_id"]).data.metrics
    shards = json.loads(Path(summary["manifests"]["shards"]).read_text())
    counts = np.bincount(_rows(shards, "train").ravel(), minlength=shards["vocab_size"])
    counts[:5] = -1  # special ids are never predicted
    top = int(counts.argmax())
    valid = torch.from_numpy(_rows(shards, "validation").astype(np.int64))
    valid = valid[: int(metrics["eval/rows"])]
    params = client.get_run(summary["mlflow_run_id"]).data.params
    _, labels = mask_tokens(
        valid, vocab_size=shards["vocab_size"], row_index=torch.arange(len(valid)),
        seed=int(params["eval.seed"]), epoch=0,
        mlm_probability=float(params["eval.mlm_probability"]),  # 15 %, not training's
        mask_replace_prob=float(params["masking.mask_replace_prob"]),
        random_replace_prob=float(params["masking.random_replace_prob"]),
    )
    predicted = labels[labels != -100]
    assert len(predicted) == metrics["eval/masked_tokens"]
    baseline = float((predicted == top).float().mean())
    assert metrics["eval/baseline_accuracy"] == pytest.approx(baseline)
    assert metrics["eval/mlm_accuracy"] > baseline


@slow
def test_validation_curve_table_plot_and_linear_probe(quickstart, tmp_path):
    """The shipped config evaluates every `every_steps` (100): points at 100, 200, ...,
    the final evaluation at `max_steps`; the fill-mask table holds every evaluation; the
    loss plot and the downstream probe (with its TF-IDF baseline) are on the run."""
    summary = _ok(quickstart)
    client = quickstart["client"]
    run_id = summary["mlflow_run_id"]
    steps = sorted({*range(EVERY, MAX_STEPS, EVERY), MAX_STEPS})
    curve = {m.step: m.value for m in client.get_metric_history(run_id, "eval/loss")}
    assert sorted(curve) == steps
    assert curve[MAX_STEPS] == pytest.approx(summary["metrics"]["eval/loss"])
    path = client.download_artifacts(run_id, "eval/fill_mask_table.json", str(tmp_path))
    table = json.loads(Path(path).read_text())  # pandas orient="split": columns, data
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert sorted({r["step"] for r in rows}) == steps
    probes = len({r["sentence"] for r in rows})
    assert probes >= 2 and len(rows) == len(steps) * probes * 5
    paths = {a.path for a in client.list_artifacts(run_id, "plots")}
    assert "plots/loss.png" in paths
    metrics = client.get_run(run_id).data.metrics
    if "probe/accuracy" in metrics:  # skipped (with a warning) when PyPI is unreachable
        assert 0.5 < metrics["probe/tfidf_accuracy"] < 0.95
        assert metrics["probe/majority_accuracy"] == pytest.approx(0.57, abs=0.02)


# --- command 2: not run again, only compared with what CI runs (fast)


def _pytest_commands(text: str) -> list[str]:
    """`python -m pytest ...` commands of a shell text (comments dropped), normalized."""
    found = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        for part in re.split(r"&&|;|\|\|", line):
            try:
                words = shlex.split(part)
            except ValueError:  # a quote split by `;` or a line continued: not a pytest call
                continue
            if words[:3] == ["python", "-m", "pytest"]:
                found.append(" ".join(words))
    return found


def test_command_2_runs_the_test_command_ci_runs():
    command = quickstart_command(2)
    readme_tests = _pytest_commands(command)
    assert readme_tests == ["python -m pytest"], command
    ci_tests = _pytest_commands(CI_RUN.read_text(encoding="utf-8"))
    assert readme_tests[0] in ci_tests, f".ci/run runs {ci_tests}"
    # and it installs the project with the dev extra and the constraints, as CI does
    assert '-e ".[dev]"' in command and "-c constraints.txt" in command


def test_command_1_is_the_plain_install_and_the_run():
    command = quickstart_command(1)
    assert "-e ." in command and ".[" not in command, "command 1 installs no extra"
    assert command.endswith("mlm-pipeline run tiny --summary-json summary.json"), command
