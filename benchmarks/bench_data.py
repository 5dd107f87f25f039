"""Data stages against Hugging Face `datasets` and `tokenizers`, on the real French corpus.

    python benchmarks/bench_data.py [--scales 1,4,16] [--work DIR]
    python benchmarks/bench_data.py --smoke      # tests/assets/tiny_fr.txt, vocab 128, seconds

`--smoke` runs every part on the test corpus (offline) at 1x, vocabulary 128; a peer whose
package is missing (`datasets` outside the `bench` extra) is skipped with a note.

Needs the `bench` extra (`pip install -e ".[bench]"`: datasets, tokenizers, psutil).
Every measured job runs in a fresh child process; its wall time and the peak resident
memory of its whole process tree (workers included, sampled every 20 ms) are reported,
with ratios against the peer measured in the same run:

1. encode + pack + write, seq_len 128, the same SentencePiece model:
   ours (`write_shards` from the ingested Parquet documents) vs HF
   (`load_dataset("json")` -> `map` tokenize with `num_proc=2` -> `group_texts` ->
   `save_to_disk`, as in `run_mlm.py`). Ours is also shown with ingestion included.
   Both are timed as child-process wall time (start-up and imports included) and
   in-process (from the job's first data call to its last write). The encode-only floor
   (SentencePiece alone on texts already in memory, 2 threads) shows how close each side
   is to what no encoder of this model can beat.
2. tokenizer training at the same vocabulary: SentencePiece unigram (our stage) vs HF
   `tokenizers` `UnigramTrainer`.
3. scaling of the shards stage alone and of ingest + shards at 1x, 4x, 16x the corpus
   (copies made distinct by a suffix, so deduplication keeps them): time per character
   and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQ_LEN = 128
VOCAB = 8000
ROOT = Path(__file__).resolve().parents[1]
#: `--smoke`: the test corpus (paragraphs are documents) and a vocabulary it can fill.
SMOKE_CORPUS = ROOT / "tests" / "assets" / "tiny_fr.txt"
SMOKE_VOCAB = 128


# ----------------------------------------------------------------------------- jobs
def _maxrss_mib() -> float:
    """Peak resident memory of this process (Linux `ru_maxrss` is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def job_ingest_shards(corpus: str, out: str, model: str, mode: str, rows_per_shard: str = "0"
                      ) -> None:
    """mode `warm`: ingest only (into `out/pre`); `shards`: time `write_shards` from the
    warm ingest's manifest; `all`: time ingest + shards into a fresh directory.
    `rows_per_shard` 0 keeps the config default."""
    import glob
    import shutil

    from mlm_pipeline.config import IngestConfig, ShardConfig
    from mlm_pipeline.manifest import CorpusManifest, TokenizerManifest, read_manifest
    from mlm_pipeline.shards.stage import write_shards

    tok = read_manifest(model, TokenizerManifest)
    cfg = IngestConfig(sources=[corpus], validation_fraction=0.0)
    shutil.rmtree(out + "/" + mode, ignore_errors=True)  # never time a cache hit
    if mode == "warm":
        from mlm_pipeline.ingest.stage import ingest

        ingest(cfg, out + "/pre")
        print(json.dumps({}))
        return
    if mode == "shards":  # read the warm manifest: no ingest code, no input hashing
        corpus_m = read_manifest(glob.glob(out + "/pre/ingest/*/manifest.json")[0],
                                 CorpusManifest)
    start = time.perf_counter()
    if mode == "all":
        from mlm_pipeline.ingest.stage import ingest

        corpus_m = ingest(cfg, out + "/all")
    shard_cfg = ShardConfig(seq_len=SEQ_LEN, **(
        {"rows_per_shard": int(rows_per_shard)} if int(rows_per_shard) else {}))
    m = write_shards(shard_cfg, corpus_m, tok, out + "/" + mode)
    print(json.dumps({"rows": m.train.rows, "tokens": m.train.tokens_in,
                      "inner_s": time.perf_counter() - start, "maxrss_mib": _maxrss_mib()}))


def job_hf_shards(corpus: str, out: str, model_file: str) -> None:
    import shutil

    import datasets
    import sentencepiece as spm

    shutil.rmtree(out, ignore_errors=True)  # fresh Arrow cache: no reuse of earlier maps
    datasets.disable_progress_bars()
    start = time.perf_counter()
    sp = spm.SentencePieceProcessor(model_file=model_file)
    ds = datasets.load_dataset("json", data_files=corpus, split="train",
                               cache_dir=out + "/hf-cache")

    def tokenize(batch):
        # The same stream as ours: pieces of each document followed by [SEP]. The same
        # SentencePiece model, batch-encoded (its default threads) to Python lists: what a
        # `datasets` user writes (`run_mlm.py` calls a tokenizer the same way).
        return {"input_ids": [ids + [3] for ids in sp.encode(batch["text"])]}

    tokenized = ds.map(tokenize, batched=True, num_proc=2, remove_columns=ds.column_names)
    body = SEQ_LEN - 1

    def group_texts(batch):  # run_mlm.py's group_texts, with a [CLS] per row
        concat = [t for ids in batch["input_ids"] for t in ids]
        total = len(concat) // body * body
        return {"input_ids": [[2] + concat[i:i + body] for i in range(0, total, body)]}

    grouped = tokenized.map(group_texts, batched=True, num_proc=2)
    grouped.save_to_disk(out + "/hf-saved")
    print(json.dumps({"rows": len(grouped), "inner_s": time.perf_counter() - start,
                      "maxrss_mib": _maxrss_mib()}))


def job_encode_floor(corpus_manifest: str, model_file: str, threads: str) -> None:
    """Pure SentencePiece encoding of the ingested documents, texts already in memory:
    the floor under any encode + pack + write. Timed two ways: SentencePiece's own batch
    threads (`num_threads`), and `threads` Python threads each encoding whole batches
    single-threaded (how `write_shards` encodes); plus the single-thread CPU time."""
    import resource
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.parquet as pq
    import sentencepiece as spm

    from mlm_pipeline.manifest import CorpusManifest, read_manifest

    m = read_manifest(corpus_manifest, CorpusManifest)
    texts = [t for e in m.train for t in pq.read_table(m.file(e.path), columns=["text"])
             .column("text").to_pylist()]
    batches = [texts[i:i + 1024] for i in range(0, len(texts), 1024)]
    sp = spm.SentencePieceProcessor(model_file=model_file)
    n = int(threads)

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    start, c0 = time.perf_counter(), cpu()
    for b in batches:
        sp.encode(b, out_type="numpy", num_threads=n)
    spm_threads = time.perf_counter() - start
    cpu_s = cpu() - c0
    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda b: sp.encode(b, out_type="numpy", num_threads=1), batches))
    py_threads = time.perf_counter() - start
    print(json.dumps({"spm_threads_s": spm_threads, "py_threads_s": py_threads,
                      "cpu_s": cpu_s, "threads": n}))


def job_spm_train(corpus_manifest: str, out: str) -> None:
    import shutil

    from mlm_pipeline.config import TokenizerConfig
    from mlm_pipeline.manifest import CorpusManifest, read_manifest
    from mlm_pipeline.tokenizer.stage import train_tokenizer

    shutil.rmtree(out + "/tokenizer", ignore_errors=True)  # never time a cache hit
    m = train_tokenizer(TokenizerConfig(vocab_size=VOCAB),
                        read_manifest(corpus_manifest, CorpusManifest), out)
    print(json.dumps({"vocab_size": m.vocab_size}))


def job_hf_train(corpus: str, out: str) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=VOCAB, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        unk_token="[UNK]", show_progress=False)

    def lines():
        with open(corpus, encoding="utf-8") as f:
            for record in f:
                for line in json.loads(record)["text"].split("\n"):
                    if line.strip():
                        yield line

    tok.train_from_iterator(lines(), trainer=trainer)
    tok.save(out + "/hf-tokenizer.json")
    print(json.dumps({"vocab_size": tok.get_vocab_size()}))


JOBS = {"ours": job_ingest_shards, "hf": job_hf_shards, "spm": job_spm_train,
        "hf-train": job_hf_train, "floor": job_encode_floor}


# ------------------------------------------------------------------------- measuring
def measure(job: str, *args: str) -> dict:
    """Run one job in a child process: wall seconds, CPU seconds of the whole tree (user +
    system, workers included: Linux adds waited-for descendants to RUSAGE_CHILDREN) and
    peak RSS (MiB) of the tree, sampled every 20 ms. CPU seconds barely change when other
    processes share the cores; wall seconds do."""
    import resource

    import psutil

    def tree_cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    cpu0 = tree_cpu()
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--vocab", str(VOCAB), "--job", job,
                             *args],
                            stdout=subprocess.PIPE, text=True)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - start
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"job {job} failed ({proc.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "wall_s": wall, "cpu_s_tree": tree_cpu() - cpu0,
            "peak_mib": peak / 2**20}


#: rows_per_shard of the extra scaling run: fewer rows than the 1x corpus's ~11,400, so
#: every scale writes several shards.
SMALL_SHARD = 8192


def _documents(smoke: bool):
    """Texts of the corpus: the default French one (fetched once), or with `smoke` the
    paragraphs of `tests/assets/tiny_fr.txt`."""
    if smoke:
        text = SMOKE_CORPUS.read_text(encoding="utf-8")
        yield from (p.strip() for p in text.split("\n\n") if p.strip())
        return
    from mlm_pipeline.ingest.corpora import default_cache_dir, fetch_debian_corpus

    for f in fetch_debian_corpus("fr", default_cache_dir()):
        for line in f.open(encoding="utf-8"):
            yield json.loads(line)["text"]


def make_corpus(work: Path, scale: int, smoke: bool = False) -> Path:
    """The default French corpus (`smoke`: the test corpus), `scale` times, each copy's
    documents made distinct."""
    path = work / f"corpus-{scale}x.jsonl"
    if path.exists():
        return path
    with path.open("w", encoding="utf-8") as out:
        for copy in range(scale):
            for text in _documents(smoke):
                if copy:
                    text += f"\n\n(copie {copy})"
                out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path


def main() -> None:
    global VOCAB
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", choices=JOBS)
    ap.add_argument("--scales", default="1,4,16")
    ap.add_argument("--compare-scale", type=int, default=16,
                    help="corpus multiple for the encode+pack+write comparison (fixed "
                         "start-up costs dominate at 1x)")
    ap.add_argument("--work", default=None)
    ap.add_argument("--skip-tokenizer-peer", action="store_true",
                    help="train our tokenizer but skip timing HF tokenizers against it")
    ap.add_argument("--smoke", action="store_true",
                    help="the test corpus at 1x, vocabulary 128, missing peers skipped: seconds")
    ap.add_argument("--vocab", type=int, default=VOCAB, help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*")
    a = ap.parse_args()
    VOCAB = a.vocab  # the jobs (child processes) get it from the parent's command line
    if a.job:
        JOBS[a.job](*a.args)
        return
    if a.smoke:
        a.scales, a.compare_scale, VOCAB = "1", 1, SMOKE_VOCAB
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        compare(a, work)
    finally:
        if a.smoke and not a.work:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


def compare(a: argparse.Namespace, work: Path) -> None:
    """Every part of the benchmark (module docstring) in `work`."""
    import importlib.util

    corpus = make_corpus(work, 1, a.smoke)
    chars = sum(len(json.loads(line)["text"]) for line in corpus.open(encoding="utf-8"))
    print(f"corpus: {corpus} ({chars / 1e6:.1f} M characters), seq_len {SEQ_LEN}, "
          f"vocab {VOCAB}, {os.cpu_count()} CPUs")

    # tokenizer training (ingest first, untimed, so both train on the same text)
    from mlm_pipeline.config import IngestConfig
    from mlm_pipeline.ingest.stage import ingest

    corpus_m = ingest(IngestConfig(sources=[str(corpus)], validation_fraction=0.0),
                      work / "tok")
    spm_r = measure("spm", str(corpus_m.path), str(work / "tok"))
    print(f"\ntokenizer training, vocab {VOCAB}:")
    print(f"  SentencePiece (ours)   {spm_r['wall_s']:7.1f} s  {spm_r['peak_mib']:7.0f} MiB")
    if not a.skip_tokenizer_peer:
        hft_r = measure("hf-train", str(corpus), str(work))
        print(f"  HF tokenizers Unigram  {hft_r['wall_s']:7.1f} s  "
              f"{hft_r['peak_mib']:7.0f} MiB")
        print(f"  speed-up: {hft_r['wall_s'] / spm_r['wall_s']:.2f}x")

    import glob
    model_manifest = glob.glob(str(work / "tok" / "tokenizer" / "*" / "manifest.json"))[0]
    model_file = str(Path(model_manifest).parent / "spm.model")

    # encode + pack + write
    big = make_corpus(work, a.compare_scale, a.smoke)
    measure("ours", str(big), str(work / "o"), model_manifest, "warm")
    ours = measure("ours", str(big), str(work / "o"), model_manifest, "shards")
    ours_all = measure("ours", str(big), str(work / "o"), model_manifest, "all")
    hf = None
    if not a.smoke or importlib.util.find_spec("datasets") is not None:
        hf = measure("hf", str(big), str(work / "hf"), model_file)
    pre = glob.glob(str(work / "o" / "pre" / "ingest" / "*" / "manifest.json"))[0]
    floor = measure("floor", pre, model_file, "2")
    hf_rows = "HF skipped" if hf is None else f"{hf['rows']:,} rows HF"
    print(f"\nencode + pack + write, {a.compare_scale}x corpus, seq_len {SEQ_LEN} "
          f"({ours['rows']:,} rows ours, {hf_rows}); process wall (start-up and "
          "imports included) / in-process time / CPU of the process tree / peak RSS of "
          "the tree:")
    for label, r in (("ours, shards stage      ", ours), ("ours, ingest + shards   ", ours_all),
                     ("HF datasets (num_proc=2)", hf)):
        if r is None:
            print(f"  {label} skipped: `datasets` is not installed (the `bench` extra)")
            continue
        print(f"  {label} {r['wall_s']:6.2f} s {r['inner_s']:6.2f} s {r['cpu_s_tree']:6.2f} "
              f"cpu-s {r['peak_mib']:6.0f} MiB")
    ideal = max(floor["cpu_s"] / 2, 1e-6)  # a tiny corpus can measure 0 cpu-s
    if hf is not None:
        print_speed_up(ours, ours_all, hf, floor, ideal)
    print_floor(ours, hf, floor, ideal)
    scaling(a, work, model_manifest)


def print_speed_up(ours: dict, ours_all: dict, hf: dict, floor: dict, ideal: float) -> None:
    """The ratios of the encode + pack + write comparison, against the HF peer."""
    print(f"  speed-up: {hf['wall_s'] / ours['wall_s']:.2f}x process wall, "
          f"{hf['inner_s'] / ours['inner_s']:.2f}x in-process, "
          f"{hf['cpu_s_tree'] / ours['cpu_s_tree']:.2f}x CPU (with our ingest "
          f"{hf['wall_s'] / ours_all['wall_s']:.2f}x wall); peak RSS ratio "
          f"{ours['peak_mib'] / hf['peak_mib']:.2f} (with ingest "
          f"{ours_all['peak_mib'] / hf['peak_mib']:.2f}); target >= 5x at <= 0.6x RSS")


def print_floor(ours: dict, hf: dict | None, floor: dict, ideal: float) -> None:
    """The encode-only floor and how close each side gets to it."""
    print(f"  encode-only floor (SentencePiece alone, texts in memory): "
          f"{floor['spm_threads_s']:.2f} s with num_threads=2, {floor['py_threads_s']:.2f} s "
          f"with 2 Python threads; {floor['cpu_s']:.2f} cpu-s, so >= {ideal:.2f} s on 2 cores")
    if hf is None:
        print(f"  in-process time / ideal floor: ours {ours['inner_s'] / ideal:.2f}")
        return
    print(f"  in-process time / ideal floor: ours {ours['inner_s'] / ideal:.2f}, HF "
          f"{hf['inner_s'] / ideal:.2f}; an encode-only job would beat HF by at most "
          f"{hf['inner_s'] / ideal:.2f}x in-process, "
          f"{hf['wall_s'] / (ideal + ours['wall_s'] - ours['inner_s']):.2f}x process wall")


def scaling(a: argparse.Namespace, work: Path, model_manifest: str) -> None:
    """Part 3: the shards stage alone and ingest + shards at each of `a.scales`."""
    print("\nscaling (in-process time; peak RSS of the process tree, its ru_maxrss in "
          "brackets; 'marginal' = extra seconds per 1x corpus since the previous scale, "
          "relative to the first step, so fixed costs do not count as non-linearity); "
          f"rows_per_shard={SMALL_SHARD} (the default is 65,536) checks that memory does not "
          "depend on the shard size:")
    base: dict[str, tuple[float, float]] = {}
    last: dict[str, tuple[int, float]] = {}
    first_step: dict[str, float] = {}
    for scale in [int(s) for s in a.scales.split(",")]:
        c = make_corpus(work, scale, a.smoke)
        d = str(work / f"s{scale}")
        measure("ours", str(c), d, model_manifest, "warm")
        for mode, label, rows in (("shards", "shards stage   ", "0"),
                                  ("all", "ingest + shards", "0"),
                                  ("shards", f"shards, {SMALL_SHARD} rows", str(SMALL_SHARD))):
            r = measure("ours", str(c), d, model_manifest, mode, rows)
            mode += rows
            inner = r["inner_s"]
            b = base.setdefault(mode, (inner / scale, r["maxrss_mib"]))
            marginal = ""
            if mode in last:
                step = (inner - last[mode][1]) / (scale - last[mode][0])
                marginal = f", marginal {step / first_step.setdefault(mode, step):.2f}"
            last[mode] = (scale, inner)
            print(f"  {scale:3d}x {label} {r['tokens']:12,} tokens  {inner:7.2f} s "
                  f"({inner / scale / b[0]:.2f} of linear{marginal})  {r['peak_mib']:5.0f} MiB "
                  f"[{r['maxrss_mib']:4.0f}] ({r['maxrss_mib'] / b[1]:.2f} of 1x)")


if __name__ == "__main__":
    main()
