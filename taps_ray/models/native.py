"""The C kernels of the static engine, built at first use and loaded through ctypes: ``q4q8.c`` (``target.weights:
q4q8``: the layers' Q4_1 x Q8_1 and the LM head's Q8_0 x Q8_1 products) and ``decode_attention.c`` (one-token
attention of a batch of requests on their own caches, :mod:`taps_ray.models.decode_attention`).

The sources ship with the package. :func:`q4q8_library` (and :func:`attention_library`) compiles one once per
machine kind with the system C
compiler (``cc -O3 -march=native -fopenmp``: about a second) into ``TAPS_CACHE/kernels/``, named by a hash of the
source, the compiler and the CPU's flags, so a cache shared across machines never hands one CPU another's
build; a process loads it once. OpenMP runs on the libgomp torch has loaded (the same soname), so the kernel's
threads are torch's.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from taps_ray import artifacts

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("q4q8.c")
ATTENTION_SOURCE = Path(__file__).with_name("decode_attention.c")
MARCH_ENV = "TAPS_KERNEL_MARCH"
"""The ``-march`` the kernel is built for (default ``native``): ``haswell`` builds the AVX2 loop on an AVX-512
machine, to measure what the AVX2 kind of machine runs."""

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: KernelBuildError | None = None
_attention: ctypes.CDLL | None = None
_attention_failure: KernelBuildError | None = None


class KernelBuildError(RuntimeError):
    """The kernel could not be built or loaded here (no C compiler, a compiler error)."""


def compiler() -> str | None:
    """The C compiler the kernel is built with: ``$CC`` where set, else ``cc``; None when there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build_flags(openmp: bool = True) -> tuple[str, ...]:
    """The compiler flags of this machine's build (without OpenMP: one thread, for a compiler that has none)."""
    return ("-O3", f"-march={os.environ.get(MARCH_ENV) or 'native'}", *(("-fopenmp",) if openmp else ()),
            "-shared", "-fPIC")


def _build_key(cc: str, source: Path = SOURCE) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256(source.read_bytes())
    for part in (version, _cpu_flags(), " ".join(build_flags())):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def kernels_dir() -> Path:
    return artifacts.cache_dir() / "kernels"


def q4q8_library() -> ctypes.CDLL:
    """The loaded kernel (built first where this machine kind has no build yet); :class:`KernelBuildError` when it
    cannot be built or loaded (a cache folder that cannot be written included), the same error again for the rest
    of the process without another try."""
    global _library, _failure
    with _lock:
        if _failure is not None:
            raise _failure
        if _library is None:
            try:
                _library = _load()
            except (OSError, KernelBuildError) as err:
                _failure = err if isinstance(err, KernelBuildError) else KernelBuildError(
                    f"the q4q8 kernel cannot be built into the cache (TAPS_CACHE): {err}")
                raise _failure from err
        return _library


def _load() -> ctypes.CDLL:
    built = _built()
    try:
        return _declare(ctypes.CDLL(str(built)))
    except OSError as err:
        raise KernelBuildError(f"the q4q8 kernel {built} does not load: {err}") from err


def _built() -> Path:
    return _build(SOURCE, "q4q8", f"target.weights=q4q8 builds its kernel with a C compiler at first use, and there is "
                  f"none here (${{CC}} or cc: {os.environ.get('CC', 'cc')!r}); install gcc or use target.weights=int4")


def _build(source: Path, stem: str, no_compiler: str) -> Path:
    """The library of ``source`` in the cache, compiled first where this machine kind has none yet."""
    cc = compiler()
    if cc is None:
        raise KernelBuildError(no_compiler)
    folder = kernels_dir()
    library = folder / f"{stem}-{_build_key(cc, source)}.so"
    if library.is_file():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        partial = Path(scratch) / library.name
        for flags in (build_flags(), build_flags(openmp=False)):
            done = subprocess.run([cc, *flags, "-o", str(partial), str(source)], capture_output=True, text=True,
                                  check=False)
            if done.returncode == 0:
                break
        else:
            raise KernelBuildError(f"building the {stem} kernel failed ({cc} {' '.join(flags)}):\n{done.stderr[-2000:]}")
        os.replace(partial, library)  # atomic: a process building beside this one never loads half a file
    return library


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    pointer, size, flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.taps_q4q8_kernel.restype = ctypes.c_char_p
    lib.taps_q4q8_packed_bytes.argtypes, lib.taps_q4q8_packed_bytes.restype = [size, size], size
    lib.taps_q4q8_pack.argtypes = [pointer, pointer, pointer, size, size, pointer]
    lib.taps_q4q8_pack.restype = None
    lib.taps_q8q8_packed_bytes.argtypes, lib.taps_q8q8_packed_bytes.restype = [size, size], size
    lib.taps_q8q8_pack.argtypes = [pointer, pointer, size, size, pointer]
    lib.taps_q8q8_pack.restype = None
    for product in (lib.taps_q4q8_matmul, lib.taps_q8q8_matmul):
        product.argtypes = [pointer, flag, size, size, pointer, pointer, size, pointer, flag, pointer, flag]
        product.restype = None
    return lib


def attention_library() -> ctypes.CDLL | None:
    """The loaded ``decode_attention.c`` kernel, or None where it cannot be built or loaded here (no C compiler, a
    cache that cannot be written: the engine then attends with torch's SDPA); tried once per process."""
    global _attention, _attention_failure
    if _attention is not None or _attention_failure is not None:
        return _attention
    with _lock:
        if _attention is None and _attention_failure is None:
            try:
                built = _build(ATTENTION_SOURCE, "decode-attention", "no C compiler (${CC} or cc) for the attention kernel")
                lib = ctypes.CDLL(str(built))
            except (OSError, KernelBuildError) as err:
                _attention_failure = err if isinstance(err, KernelBuildError) else KernelBuildError(str(err))
                log.info("one-token attention runs in torch's SDPA in this process: %s", _attention_failure)
                return None
            pointer, size = ctypes.c_void_p, ctypes.c_int64
            lib.taps_decode_attention.argtypes = [size, pointer, pointer, pointer, pointer, size, size, size, size,
                                                  pointer, pointer, pointer, ctypes.c_float, pointer, ctypes.c_int]
            lib.taps_decode_attention.restype = ctypes.c_int
            _attention = lib
        return _attention


def q4q8_kernel() -> str:
    """Which build runs here: ``avx512-vnni``, ``avx2`` or ``portable``."""
    return q4q8_library().taps_q4q8_kernel().decode()


def pack_q4q8(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The kernel's packed weight (uint8) of ``codes`` [N, K] (0..15) and ``scale``, ``minimum`` [N, K / 32]; the
    scales and minima are stored in fp16 (a GGUF's own are fp16: exact)."""
    lib = q4q8_library()
    n, k = codes.shape
    out = torch.empty(lib.taps_q4q8_packed_bytes(n, k), dtype=torch.uint8)
    codes, scale_half, minimum_half = (codes.to(torch.uint8).contiguous(), scale.half().contiguous(),
                                       minimum.half().contiguous())
    lib.taps_q4q8_pack(codes.data_ptr(), scale_half.data_ptr(), minimum_half.data_ptr(), n, k, out.data_ptr())
    return out


def pack_q8q8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel's packed Q8_0 weight (uint8) of ``codes`` [N, K] (int8, -127..127) and ``scale`` [N, K / 32]
    (stored in fp16)."""
    lib = q4q8_library()
    n, k = codes.shape
    out = torch.empty(lib.taps_q8q8_packed_bytes(n, k), dtype=torch.uint8)
    codes, scale_half = codes.to(torch.int8).contiguous(), scale.half().contiguous()
    lib.taps_q8q8_pack(codes.data_ptr(), scale_half.data_ptr(), n, k, out.data_ptr())
    return out


def q4q8_matmul(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                codes: str = "q4") -> torch.Tensor:
    """``x`` [M, K] (float32 or bfloat16, contiguous) times the packed weight of ``n`` outputs (``codes``: ``q4``,
    from :func:`pack_q4q8`, or ``q8``, from :func:`pack_q8q8`; + ``bias`` [n] float32): [M, n] in ``x``'s dtype."""
    lib = _library or q4q8_library()  # loaded once: no lock on the decoding path
    product = lib.taps_q4q8_matmul if codes == "q4" else lib.taps_q8q8_matmul
    m, k = x.shape
    out = torch.empty(m, n, dtype=x.dtype)
    work = torch.empty(m * k + 16 + 8 * m * (k // 32), dtype=torch.uint8)
    bf16 = int(x.dtype == torch.bfloat16)
    product(x.data_ptr(), bf16, m, k, packed.data_ptr(), None if bias is None else bias.data_ptr(), n, out.data_ptr(),
            bf16, work.data_ptr(), torch.get_num_threads())
    return out
