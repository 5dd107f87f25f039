"""Data stages against Hugging Face `datasets` and `tokenizers`, on the real French corpus.

    python benchmarks/bench_data.py [--scales 1,4,16] [--work DIR]

Needs the `bench` extra (`pip install -e ".[bench]"`: datasets, tokenizers, psutil).
Every measured job runs in a fresh child process; its wall time and the peak resident
memory of its whole process tree (workers included, sampled every 20 ms) are reported,
with ratios against the peer measured in the same run:

1. encode + pack + write, seq_len 128, the same SentencePiece model:
   ours (`write_shards` from the ingested Parquet documents) vs HF
   (`load_dataset("json")` -> `map` tokenize with `num_proc=2` -> `group_texts` ->
   `save_to_disk`, as in `run_mlm.py`). Ours is also shown with ingestion included.
2. tokenizer training at the same vocabulary: SentencePiece unigram (our stage) vs HF
   `tokenizers` `UnigramTrainer`.
3. scaling of ingest + shards at 1x, 4x, 16x the corpus (copies made distinct by a
   suffix, so deduplication keeps them): time per character and peak RSS.
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


# ----------------------------------------------------------------------------- jobs
def job_ingest_shards(corpus: str, out: str, model: str, mode: str) -> None:
    """mode `warm`: ingest only (into `out/pre`); `shards`: time `write_shards` from the
    warm ingest; `all`: time ingest + shards into a fresh directory."""
    from mlm_pipeline.config import IngestConfig, ShardConfig
    from mlm_pipeline.ingest import ingest
    from mlm_pipeline.manifest import TokenizerManifest, read_manifest
    from mlm_pipeline.shards import write_shards

    tok = read_manifest(model, TokenizerManifest)
    cfg = IngestConfig(sources=[corpus], validation_fraction=0.0)
    if mode in ("warm", "shards"):
        corpus_m = ingest(cfg, out + "/pre")
        if mode == "warm":
            print(json.dumps({}))
            return
    start = time.perf_counter()
    if mode == "all":
        corpus_m = ingest(cfg, out + "/all")
    m = write_shards(ShardConfig(seq_len=SEQ_LEN), corpus_m, tok, out + "/" + mode)
    print(json.dumps({"rows": m.train.rows, "tokens": m.train.tokens_in,
                      "inner_s": time.perf_counter() - start}))


def job_hf_shards(corpus: str, out: str, model_file: str) -> None:
    import datasets
    import sentencepiece as spm

    datasets.disable_progress_bars()
    sp = spm.SentencePieceProcessor(model_file=model_file)
    ds = datasets.load_dataset("json", data_files=corpus, split="train",
                               cache_dir=out + "/hf-cache")

    def tokenize(batch):
        # the same stream as ours: pieces of each document followed by [SEP]
        return {"input_ids": [ids + [3] for ids in sp.encode(batch["text"])]}

    tokenized = ds.map(tokenize, batched=True, num_proc=2, remove_columns=ds.column_names)
    body = SEQ_LEN - 1

    def group_texts(batch):  # run_mlm.py's group_texts, with a [CLS] per row
        concat = [t for ids in batch["input_ids"] for t in ids]
        total = len(concat) // body * body
        return {"input_ids": [[2] + concat[i:i + body] for i in range(0, total, body)]}

    grouped = tokenized.map(group_texts, batched=True, num_proc=2)
    grouped.save_to_disk(out + "/hf-saved")
    print(json.dumps({"rows": len(grouped)}))


def job_spm_train(corpus_manifest: str, out: str) -> None:
    from mlm_pipeline.config import TokenizerConfig
    from mlm_pipeline.manifest import CorpusManifest, read_manifest
    from mlm_pipeline.tokenizer import train_tokenizer

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
        "hf-train": job_hf_train}


# ------------------------------------------------------------------------- measuring
def measure(job: str, *args: str) -> dict:
    """Run one job in a child process; wall seconds and peak RSS (MiB) of its tree."""
    import psutil

    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--job", job, *args],
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
    return {**result, "wall_s": wall, "peak_mib": peak / 2**20}


def make_corpus(work: Path, scale: int) -> Path:
    """The default French corpus, `scale` times, each copy's documents made distinct."""
    from mlm_pipeline.corpora import default_cache_dir, fetch_debian_corpus

    path = work / f"corpus-{scale}x.jsonl"
    if path.exists():
        return path
    files = fetch_debian_corpus("fr", default_cache_dir())
    with path.open("w", encoding="utf-8") as out:
        for copy in range(scale):
            for f in files:
                for line in f.open(encoding="utf-8"):
                    doc = json.loads(line)
                    if copy:
                        doc["text"] += f"\n\n(copie {copy})"
                    out.write(json.dumps({"text": doc["text"]}, ensure_ascii=False) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", choices=JOBS)
    ap.add_argument("--scales", default="1,4,16")
    ap.add_argument("--compare-scale", type=int, default=16,
                    help="corpus multiple for the encode+pack+write comparison (fixed "
                         "start-up costs dominate at 1x)")
    ap.add_argument("--work", default=None)
    ap.add_argument("args", nargs="*")
    a = ap.parse_args()
    if a.job:
        JOBS[a.job](*a.args)
        return
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(work, 1)
    chars = sum(len(json.loads(line)["text"]) for line in corpus.open(encoding="utf-8"))
    print(f"corpus: {corpus} ({chars / 1e6:.1f} M characters), seq_len {SEQ_LEN}, "
          f"vocab {VOCAB}, {os.cpu_count()} CPUs")

    # tokenizer training (ingest first, untimed, so both train on the same text)
    from mlm_pipeline.config import IngestConfig
    from mlm_pipeline.ingest import ingest

    corpus_m = ingest(IngestConfig(sources=[str(corpus)], validation_fraction=0.0),
                      work / "tok")
    spm_r = measure("spm", str(corpus_m.path), str(work / "tok"))
    hft_r = measure("hf-train", str(corpus), str(work))
    print(f"\ntokenizer training, vocab {VOCAB}:")
    print(f"  SentencePiece (ours)   {spm_r['wall_s']:7.1f} s  {spm_r['peak_mib']:7.0f} MiB")
    print(f"  HF tokenizers Unigram  {hft_r['wall_s']:7.1f} s  {hft_r['peak_mib']:7.0f} MiB")
    print(f"  speed-up: {hft_r['wall_s'] / spm_r['wall_s']:.2f}x")

    import glob
    model_manifest = glob.glob(str(work / "tok" / "tokenizer" / "*" / "manifest.json"))[0]
    model_file = str(Path(model_manifest).parent / "spm.model")

    # encode + pack + write
    big = make_corpus(work, a.compare_scale)
    measure("ours", str(big), str(work / "o"), model_manifest, "warm")
    ours = measure("ours", str(big), str(work / "o"), model_manifest, "shards")
    ours_all = measure("ours", str(big), str(work / "o"), model_manifest, "all")
    hf = measure("hf", str(big), str(work / "hf"), model_file)
    print(f"\nencode + pack + write, {a.compare_scale}x corpus, seq_len {SEQ_LEN} "
          f"({ours['rows']:,} rows ours, {hf['rows']:,} HF):")
    print(f"  ours, shards stage        {ours['wall_s']:7.1f} s  {ours['peak_mib']:7.0f} MiB")
    print(f"  ours, ingest + shards     {ours_all['wall_s']:7.1f} s  "
          f"{ours_all['peak_mib']:7.0f} MiB")
    print(f"  HF datasets (num_proc=2)  {hf['wall_s']:7.1f} s  {hf['peak_mib']:7.0f} MiB")
    print(f"  speed-up {hf['wall_s'] / ours['wall_s']:.2f}x (with ingest "
          f"{hf['wall_s'] / ours_all['wall_s']:.2f}x); peak RSS ratio "
          f"{ours['peak_mib'] / hf['peak_mib']:.2f} (with ingest "
          f"{ours_all['peak_mib'] / hf['peak_mib']:.2f})")

    # scaling
    print("\nscaling, ingest + shards (child process wall time includes ~1-2 s start-up):")
    base = None
    for scale in [int(s) for s in a.scales.split(",")]:
        c = make_corpus(work, scale)
        r = measure("ours", str(c), str(work / f"s{scale}"), model_manifest, "all")
        inner = r["inner_s"]
        base = base or (inner, r["peak_mib"])
        print(f"  {scale:3d}x  {r['tokens']:12,} tokens  {inner:7.1f} s  "
              f"({inner / scale / base[0]:.2f} of linear)  {r['peak_mib']:7.0f} MiB "
              f"({r['peak_mib'] / base[1]:.2f} of 1x)")


if __name__ == "__main__":
    main()
