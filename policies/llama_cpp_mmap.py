"""llama-cpp-mmap: llama.cpp's default memory-mapped weights with ``--cpu-moe``/``--n-cpu-moe``.

Source: llama.cpp (ggml-org/llama.cpp), ``src/llama-mmap.cpp`` (``llama_mmap``: the GGUF file
is mapped read-only and shared, ``PROT_READ``/``MAP_SHARED``, with an optional
``POSIX_MADV_WILLNEED`` prefetch hint; ``unmap_fragment`` drops ranges whose tensors were
copied elsewhere) and ``src/llama-model-loader.cpp`` (with ``use_mmap``, tensors kept in a CPU
buffer point into the mapping instead of being read into allocated memory; tensors of a GPU
buffer are copied out of the mapping once at load); ``--mmap``/``--no-mmap`` and ``--mlock``
in the server and CLI documentation (tools/server/README.md). The mechanism and its sources
are in docs/serving.md, "An SSD tier", and docs/references.md#llama-cpp-mmap.

- Placement: that of ``llama-cpp-cpu-moe`` (``n_cpu_moe``; ``-1``, the default, is
  ``--cpu-moe``): the routed experts of the first N blocks are CPU tensors, every expert of
  the other layers is resident on the GPU (loaded once, never evicted). No other GPU cache.
- Host memory: the CPU experts are the pages of the mapping, so the page cache holds what the
  OS keeps of them (``ResourceSpec.ssd_access = "mmap"``); with a host-memory budget
  (``--host-memory-gb``) that is the host tier's least-recently-used set, and a CPU expert
  whose pages are not in it is faulted in from the NVMe drive on first touch, at the drive's
  4 KiB random-read rate, before the CPU runs it. Without a budget the whole file is cached
  (the behaviour of ``llama-cpp-cpu-moe``). Pages are pageable memory, not pinned.
- Decode and prefill: as ``llama-cpp-cpu-moe`` (prompt batches of at least 32 tokens copy a
  CPU layer's used experts to the GPU; those copies read the mapping's pages too).
"""

from __future__ import annotations

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import ResourceSpec
from daopsim.policies.llama_cpp_cpu_moe import LlamaCppCpuMoePolicy
from daopsim.policies.registry import register


@mypyc_attr(allow_interpreted_subclasses=True)
class LlamaCppMmapPolicy(LlamaCppCpuMoePolicy):
    """llama.cpp with mmapped weights: CPU experts read from the page cache, faulted in from
    the SSD on first touch; the GPU layers' experts resident."""

    name = "llama-cpp-mmap"
    summary = (
        "llama.cpp with mmapped weights: --n-cpu-moe placement, CPU experts paged in from "
        "the SSD through the page cache"
    )
    source = "llama.cpp llama-mmap.cpp / llama-model-loader.cpp (use_mmap), --mmap"
    # the mapping's pages are pageable by construction: no host-memory option
    params = {k: v for k, v in LlamaCppCpuMoePolicy.params.items() if k != "host_memory"}

    def resources(self) -> ResourceSpec:
        """Pageable host memory (the mapping's pages), mmap access, one copy buffer, one CPU
        worker; each tensor held once (the loader unmaps the ranges it copied to the GPU)."""
        return ResourceSpec(
            host_memory="pageable",
            temp_buffers=1,
            cpu_workers=1,
            ssd_access="mmap",
            host_copies="offloaded",
        )


register(LlamaCppMmapPolicy)
