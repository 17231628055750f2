"""`femtotron preprocess` throughput against the tokenizer's own speed, per input format and worker count,
and its peak memory against the input's size.

The bundled corpus (examples/data/shakespeare.jsonl.gz), its documents repeated to --megabytes of text, is
written as .jsonl, .jsonl.gz, .jsonl.zst and .parquet (row groups of about 4 MB of text). For each format and
each worker count N, in processes of their own with N tokenizer threads (RAYON_NUM_THREADS=N):

    femtotron       preprocess(input, examples/tokenizer.json, ..., workers=N): reading, tokenizing,
                    writing the .bin/.idx; its MB/s of text and tokens/s, and its peak resident memory
                    (VmHWM of the main process; a worker's is about one chunk)
    baseline        `tokenizers`' encode_batch of the same texts, already in memory, with N threads, in
                    the batches preprocess sends its workers (one batch of a whole corpus is slower: its
                    Encodings outgrow the caches and take ~40 bytes a character): the speed limit of any
                    tool whose work is tokenizing

and prints the ratio femtotron ÷ baseline (goal: >= 0.8), and the peak memory ÷ the input's size.

    python bench/preprocess.py [--megabytes 200] [--workers 1,2] [--formats jsonl,jsonl.gz,jsonl.zst,parquet]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from common import headline

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "examples" / "data" / "shakespeare.jsonl.gz"
TOKENIZER = ROOT / "examples" / "tokenizer.json"
# pyarrow decodes a row group's column whole, so parquet's peak memory follows its row groups' size
GROUP_BYTES = 4e6

# Each run in a process of its own: the thread count is fixed when `tokenizers` starts its pool, and the
# peak memory is that process's alone.
OURS = """
import json, sys, time
from femtotron.data.preprocess import preprocess
source, tokenizer, prefix, workers = sys.argv[1:5]
start = time.perf_counter()
summary = preprocess(source, tokenizer, prefix, workers=int(workers), progress=False)
seconds = time.perf_counter() - start
peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1]
print(json.dumps({"seconds": seconds, "tokens": summary.tokens, "peak": int(peak) * 1024}))
"""
BASELINE = """
import json, sys, time
from tokenizers import Tokenizer
from femtotron.data.preprocess import _chunks
texts = [json.loads(line)["text"] for line in open(sys.argv[1], encoding="utf-8")]
batches = list(_chunks(texts))
tokenizer = Tokenizer.from_file(sys.argv[2])
start = time.perf_counter()
tokens = sum(len(e.ids) for batch in batches for e in tokenizer.encode_batch(batch, add_special_tokens=False))
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}))
"""


def write_inputs(directory: Path, megabytes: float, formats: list[str]) -> tuple[dict[str, Path], int]:
    """The corpus's documents repeated to `megabytes` of text, in each format; returns the files and the
    text's size in bytes (UTF-8)."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        documents = [json.loads(line)["text"] for line in f if line.strip()]
    texts = []
    size = 0
    while size < megabytes * 1e6:
        for text in documents:
            texts.append(text)
            size += len(text.encode("utf-8"))
    lines = "".join(json.dumps({"text": text}) + "\n" for text in texts)
    files = {}
    for kind in formats:
        path = directory / f"corpus.{kind}"
        if kind == "jsonl":
            path.write_text(lines, encoding="utf-8")
        elif kind == "jsonl.gz":
            path.write_bytes(gzip.compress(lines.encode(), compresslevel=6))
        elif kind == "jsonl.zst":
            path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
        else:  # row groups of about 4 MB of text, as 1,000-row groups of web documents of a few KB are
            rows = max(1, int(GROUP_BYTES * len(texts) / size))
            pq.write_table(pa.table({"text": texts}), path, row_group_size=rows)
        files[kind] = path
    if "jsonl" not in files:  # the baseline reads the plain lines
        (directory / "corpus.jsonl").write_text(lines, encoding="utf-8")
    return files, size


def run(script: str, threads: int, *args: str) -> dict:
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=200.0, help="of text (UTF-8)")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--formats", default="jsonl,jsonl.gz,jsonl.zst,parquet")
    args = parser.parse_args()
    formats = args.formats.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        files, size = write_inputs(directory, args.megabytes, formats)
        print(f"{size / 1e6:.1f} MB of text ({CORPUS.name} repeated), tokenizer {TOKENIZER.name}")
        for workers in map(int, args.workers.split(",")):
            baseline = run(BASELINE, workers, str(directory / "corpus.jsonl"), str(TOKENIZER))
            limit = size / 1e6 / baseline["seconds"]
            print(f"  {workers} thread(s): tokenizers' encode_batch {limit:.2f} MB/s")
            for kind, path in files.items():
                ours = run(
                    OURS, workers, str(path), str(TOKENIZER), str(directory / f"out-{kind}"), str(workers)
                )
                speed = size / 1e6 / ours["seconds"]
                print(
                    f"    {kind:<10} {speed:6.2f} MB/s {ours['tokens'] / ours['seconds']:11,.0f} tokens/s "
                    f"{speed / limit:5.2f}x the tokenizer; peak memory {ours['peak'] / 2**20:,.0f} MiB, "
                    f"{ours['peak'] / size:.2f}x the text"
                )
                headline(
                    f"preprocess {kind}, {workers} worker(s), {size / 1e6:.0f} MB: MB/s, femtotron / "
                    "tokenizers' encode_batch",
                    speed,
                    limit,
                    ".2f",
                )


if __name__ == "__main__":
    main()
