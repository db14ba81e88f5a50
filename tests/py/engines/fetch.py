#!/usr/bin/env python3
"""Fetch the pinned vLLM and SGLang wheels and extract the sources the engine tests run (the KV
event code; vLLM's Responses and Messages API conversions).

    python3 tests/py/engines/fetch.py        # prints the source directory (KVLB_ENGINE_SRC)

The engine tests (tests/engine_events.rs) run the engines' own Python files, unmodified, behind
the import shims in tests/py/engines/shims. This script is the one way to get those files:

- `pip download --no-deps` of each pinned wheel, for CPython 3.11 on manylinux x86_64 whatever
  the local interpreter, checked against the pinned sha256 (pip's --require-hashes, then again
  here);
- only the files listed below are extracted, into <cache>/src/<name>-<version>/, through a
  temporary directory renamed into place, with a stamp naming the wheel's hash and the files;
- when the stamp matches, nothing else happens: no network, no wheel read. A wheel already in
  <cache>/wheels with the right hash is extracted without downloading it again.

The cache is $KVLB_ENGINE_CACHE, else $XDG_CACHE_HOME/kvlb/engines, else ~/.cache/kvlb/engines:
outside the repository. Concurrent runs serialize on a lock file there.
"""

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ENGINES = [
    {
        "name": "vllm",
        "version": "0.33.0",
        "wheel": "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "sha256": "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
        "abi": "abi3",
        "platform": "manylinux_2_28_x86_64",
        "files": [
            # imported by the driver
            "vllm/distributed/kv_events.py",
            "vllm/config/kv_events.py",
            # read, not imported: when the block pool emits which event
            "vllm/v1/core/block_pool.py",
            # imported by agent_convert.py: the Responses and Messages API conversions and the
            # request protocols they validate with
            "vllm/envs.py",
            "vllm/exceptions.py",
            "vllm/logprobs.py",
            "vllm/renderers/params.py",
            "vllm/renderers/chat_utils/types.py",
            "vllm/renderers/chat_utils/tool_call.py",
            "vllm/renderers/chat_utils/chat_message.py",
            "vllm/renderers/chat_utils/content_parser.py",
            "vllm/entrypoints/serve/engine/protocol.py",
            "vllm/entrypoints/generate/base/protocol.py",
            "vllm/entrypoints/openai/chat_completion/protocol.py",
            "vllm/entrypoints/openai/responses/protocol.py",
            "vllm/entrypoints/openai/responses/utils.py",
            "vllm/tool_parsers/utils.py",
            "vllm/entrypoints/anthropic/protocol.py",
            "vllm/entrypoints/anthropic/serving.py",
            # read, not imported: how the servers call the conversions
            "vllm/renderers/online_renderer.py",
            "vllm/entrypoints/openai/responses/serving.py",
        ],
    },
    {
        "name": "sglang",
        "version": "0.5.23",
        "wheel": "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
        "sha256": "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
        "abi": "cp311",
        "platform": "manylinux_2_34_x86_64",
        "files": [
            # imported by the driver
            "sglang/srt/disaggregation/kv_events.py",
            "sglang/srt/mem_cache/events.py",
            "sglang/srt/mem_cache/utils.py",
            "sglang/srt/mem_cache/evict_policy.py",
            "sglang/srt/mem_cache/cpp_utils/native_hash.py",
            # read, not imported: when the radix tree records which event
            "sglang/srt/mem_cache/radix_cache.py",
        ],
    },
]


def cache_dir():
    if os.environ.get("KVLB_ENGINE_CACHE"):
        return os.path.abspath(os.environ["KVLB_ENGINE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "kvlb", "engines")


def log(msg):
    print(f"fetch.py: {msg}", file=sys.stderr, flush=True)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def stamp_of(engine):
    return {"wheel": engine["wheel"], "sha256": engine["sha256"], "files": engine["files"]}


def download(engine, wheels):
    """pip download the pinned wheel into `wheels`; returns its path."""
    tmp = tempfile.mkdtemp(prefix=".download-", dir=wheels)
    try:
        req = os.path.join(tmp, "requirements.txt")
        with open(req, "w") as f:
            f.write(f"{engine['name']}=={engine['version']} --hash=sha256:{engine['sha256']}\n")
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--no-cache-dir", "--progress-bar", "off",
            "--python-version", "3.11", "--implementation", "cp", "--abi", engine["abi"],
            "--platform", engine["platform"], "--require-hashes", "-r", req, "-d", tmp,
        ]  # fmt: skip
        started = time.monotonic()
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if out.returncode != 0:
            raise SystemExit(
                f"fetch.py: `{' '.join(cmd)}` failed (exit {out.returncode}):\n{out.stdout}"
            )
        got = os.path.join(tmp, engine["wheel"])
        if not os.path.exists(got):
            raise SystemExit(
                f"fetch.py: pip downloaded {os.listdir(tmp)}, not {engine['wheel']}:\n{out.stdout}"
            )
        digest = sha256_of(got)
        if digest != engine["sha256"]:
            raise SystemExit(
                f"fetch.py: {engine['wheel']} has sha256 {digest}, want {engine['sha256']}"
            )
        dest = os.path.join(wheels, engine["wheel"])
        os.replace(got, dest)
        log(f"downloaded {engine['wheel']} in {time.monotonic() - started:.1f}s")
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def extract(engine, wheel, src):
    dest = os.path.join(src, f"{engine['name']}-{engine['version']}")
    tmp = tempfile.mkdtemp(prefix=".extract-", dir=src)
    try:
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
            for name in engine["files"]:
                if name not in names:
                    raise SystemExit(f"fetch.py: {engine['wheel']} has no {name}")
                target = os.path.join(tmp, name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with z.open(name) as r, open(target, "wb") as w:
                    shutil.copyfileobj(r, w)
        with open(os.path.join(tmp, ".kvlb-stamp.json"), "w") as f:
            json.dump(stamp_of(engine), f)
        if os.path.exists(dest):
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch_one(engine, root):
    src = os.path.join(root, "src")
    dest = os.path.join(src, f"{engine['name']}-{engine['version']}")
    try:
        with open(os.path.join(dest, ".kvlb-stamp.json")) as f:
            if json.load(f) == stamp_of(engine):
                return
    except (OSError, ValueError):
        pass
    wheels = os.path.join(root, "wheels")
    os.makedirs(wheels, exist_ok=True)
    os.makedirs(src, exist_ok=True)
    wheel = os.path.join(wheels, engine["wheel"])
    if not (os.path.exists(wheel) and sha256_of(wheel) == engine["sha256"]):
        wheel = download(engine, wheels)
    extract(engine, wheel, src)
    log(f"extracted {len(engine['files'])} files of {engine['wheel']} into {dest}")


def main():
    root = cache_dir()
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for engine in ENGINES:
            fetch_one(engine, root)
    print(os.path.join(root, "src"))


if __name__ == "__main__":
    main()
