"""Layer-wise asynchronous push: ``transfer_cache_async`` and ``CacheTask``
(llm_datadist_api.md §7.10, §7.11, §8.5, §10.5).

``transfer_cache_async`` validates its arguments the way llm_datadist does (llm_datadist_api.md §10.5 rules 1-6,
raising ``TypeError`` / ``ValueError`` / ``LLMException(LLM_PARAM_INVALID)`` before anything
starts), then runs the layer loop on a background thread:

* for ``layer`` in ``0 .. num_layers-1``: the configs whose ``src_layer_range`` holds the layer are
  picked (a layer nobody wants is skipped without calling the synchronizer);
* ``layer_synchronizer.synchronize_layer(layer, None)``; ``False`` marks the picked configs
  ``LLM_PARAM_INVALID`` and stops;
* each picked config pushes the layer's two tensors ``[2*layer, 2*layer+1]``; the first failure
  records its code and stops everything; a config's last layer records ``LLM_SUCCESS``.

Results are keyed by ``dst_cluster_id`` (two configs to one cluster share a slot), and
``CacheTask.get_results`` returns them per config, in order (``None``: never transferred).

A running job is held by its manager's ``AsyncTasks``: ``LLMDataDist.finalize`` stops it with
``LLM_PARAM_INVALID`` and ``unlink_clusters`` stops its configs to the unlinked clusters with
``LLM_NOT_YET_LINK`` (the codes upstream's next push gets then): the push in flight, cut by the
closing link, and the next push record that code, and the loop ends there as at any failure.
A dropped ``CacheTask`` does not stop its job (upstream's thread runs on too).

The module is shared by the v2 ``CacheManager`` and the v1 ``KvCacheManager``: the caller passes
the function that runs one native transfer (``CacheManager._transfer``'s signature), whether the
source is a blocks cache, the mode (remote-accessible or not) and the timeout code.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ...status import LLMException, LLMStatusCode, code_2_status
from ._utils import (
    check_isinstance,
    check_list_uint64,
    check_uint32,
    check_uint64,
    handle_llm_status,
    llm_api,
    raise_if_false,
)
from .llm_types import BlocksCacheKey, LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig

__all__ = ["AsyncTasks", "CacheTask", "transfer_cache_async"]

logger = logging.getLogger("pdlink")

# llm_datadist hard-codes two tensors (K, V) per layer for layer-wise transfers (llm_datadist_api.md §10.5 rule 1).
_TENSORS_PER_LAYER = 2
_OP = "transfer_cache_async"

Run = tuple[int, int]  # (offset or address, length)
TransferConfigLike = TransferConfig | TransferWithCacheKeyConfig


class _PlanError(Exception):
    """A config that the engine would refuse; reported as LLM_PARAM_INVALID at its first layer."""


# ---------------------------------------------------------------------------- CacheTask


def _join_seconds(timeout_in_millis: int | None) -> float | None:
    if timeout_in_millis is None:
        return None
    check_uint32("timeout_in_millis", timeout_in_millis)
    return timeout_in_millis / 1000


@llm_api
class CacheTask:
    """Handle of one ``transfer_cache_async`` call (llm_datadist_api.md §7.11). Users do not construct it.

    Both methods wait for the worker thread (``timeout_in_millis``: uint32 milliseconds, None =
    wait for ever). If it is still running (or died of an unexpected exception, e.g. raised by the
    synchronizer) they answer with the timeout code: ``LLM_TIMEOUT`` in CacheManager mode,
    ``LLM_WAIT_PROCESS_TIMEOUT`` in KvCacheManager mode. Waiting again later is fine.
    """

    def __init__(self, job: _TransferJob, timeout_code: LLMStatusCode) -> None:
        self._job = job
        self._timeout_code = timeout_code

    def _finished(self, timeout_in_millis: int | None) -> bool:
        seconds = _join_seconds(timeout_in_millis)
        self._job.join(seconds)
        return not self._job.is_alive() and self._job.error is None

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """The first non-success code over all configs (``None`` entries ignored), else ``LLM_SUCCESS``."""
        if not self._finished(timeout_in_millis):
            return self._timeout_code
        for ret in self._job.results():
            if ret is not None and ret != LLMStatusCode.LLM_SUCCESS:
                return ret
        return LLMStatusCode.LLM_SUCCESS

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """One code per transfer config, in order; ``None`` for a config that never transferred."""
        if not self._finished(timeout_in_millis):
            return [self._timeout_code] * self._job.num_configs
        return self._job.results()

    def __repr__(self) -> str:
        state = "running" if self._job.is_alive() else "done"
        return f"CacheTask({state}, num_transfer_configs={self._job.num_configs})"


# ---------------------------------------------------------------------------- byte runs


def _coalesce(runs: Sequence[tuple[int, int, int]]) -> tuple[list[Run], list[Run]]:
    """(local_offset, remote_offset, length) triples -> local and remote run lists, merging runs
    that are consecutive on both sides."""
    local: list[Run] = []
    remote: list[Run] = []
    for loff, roff, n in runs:
        if local and local[-1][0] + local[-1][1] == loff and remote[-1][0] + remote[-1][1] == roff:
            local[-1] = (local[-1][0], local[-1][1] + n)
            remote[-1] = (remote[-1][0], remote[-1][1] + n)
        else:
            local.append((loff, n))
            remote.append((roff, n))
    return local, remote


class _Layout:
    """The source cache's geometry, as the engine sees it (``stride`` = one slot or one block)."""

    def __init__(self, src_cache: Any, src_is_blocks: bool) -> None:
        desc = src_cache.cache_desc
        self.is_blocks = src_is_blocks
        self.tensor_size = desc.size
        self.num_slots = desc.shape[0]
        self.stride = self.tensor_size // self.num_slots if self.num_slots > 0 else 0

    def region(self, index: int) -> int:
        """Offset of slot (or block) ``index``: the source of a cache-to-cache / cache-to-blocks push."""
        if not 0 <= index < self.num_slots:
            raise _PlanError(f"src_batch_index {index} out of range [0, {self.num_slots})")
        return index * self.stride

    def chunks(self, base: int, dst_blocks: Sequence[int], block_size: int) -> list[tuple[int, int, int]]:
        """Contiguous source -> blocks: the slot at ``base`` cut into ``block_size`` chunks; chunk ``j``
        goes to block ``dst_blocks[j]`` (the last chunk may be short)."""
        if block_size <= 0:
            raise _PlanError("dst_block_memory_size must be > 0 when pushing a contiguous cache into blocks")
        num_chunks = -(-self.stride // block_size)
        if len(dst_blocks) > num_chunks:
            raise _PlanError(f"the source slot ({self.stride} bytes) splits into {num_chunks} blocks of "
                             f"{block_size} bytes, fewer than the {len(dst_blocks)} dst_block_indices")
        return [(base + j * block_size, d * block_size, min(block_size, self.stride - j * block_size))
                for j, d in enumerate(dst_blocks)]

    def pairs(self, src_blocks: Sequence[int], dst_blocks: Sequence[int],
              block_size: int | None) -> list[tuple[int, int, int]]:
        """Blocks -> blocks: block ``src_blocks[i]`` to block ``dst_blocks[i]``, both of the source's block size."""
        if not self.is_blocks:
            raise _PlanError("src_block_indices need a blocks src_cache")
        if block_size and block_size != self.stride:
            raise _PlanError(f"dst_block_memory_size {block_size} differs from the src block size {self.stride}")
        for b in src_blocks:
            if b >= self.num_slots:
                raise _PlanError(f"src block index {b} out of range [0, {self.num_slots})")
        return [(s * self.stride, d * self.stride, self.stride) for s, d in zip(src_blocks, dst_blocks)]


class _Target:
    """One transfer config, frozen at call time, with the layer-independent part of its transfer."""

    def __init__(self, config: TransferConfigLike, num_layers: int) -> None:
        self.dst_cluster_id: int = config.dst_cluster_id
        self.src_range: range = config.src_layer_range if config.src_layer_range is not None else range(num_layers)
        self.batch_index: int = config.src_batch_index
        self.raw = isinstance(config, TransferConfig)
        if isinstance(config, TransferConfig):  # self.raw
            self.key = None
            self.dst_addrs: list[int] = list(config.dst_addrs)
            self.dst_start = 0
        else:
            self.key = config.cache_key
            self.dst_addrs = []
            self.dst_start = config.dst_layer_range.start
        self.mode = "EXPLICIT"
        self.kwargs: dict[str, Any] = {}
        self.error: str | None = None

    def plan(self, layout: _Layout, src_blocks: Sequence[int], dst_blocks: Sequence[int],
             block_size: int | None) -> None:
        """Work out the mode and runs once; a config the engine would refuse keeps its reason in
        ``error`` and fails with LLM_PARAM_INVALID when its first layer is due (as upstream)."""
        try:
            self._plan(layout, src_blocks, dst_blocks, block_size)
        except _PlanError as e:
            self.error = str(e)

    def _plan(self, layout: _Layout, src_blocks: Sequence[int], dst_blocks: Sequence[int],
              block_size: int | None) -> None:
        if self.raw:
            # Raw remote memory: explicit runs, remote offsets relative to each dst address.
            if not dst_blocks:  # cache -> cache: one whole slot (or one block of a blocks source)
                runs = [(layout.region(self.batch_index), 0, layout.stride)]
            elif src_blocks:  # blocks -> blocks
                runs = layout.pairs(src_blocks, dst_blocks, block_size)
            else:  # cache -> blocks
                runs = layout.chunks(layout.region(self.batch_index), dst_blocks, block_size or 0)
            local, remote = _coalesce(runs)
            self.kwargs = {"local_runs": local, "remote_runs": remote}
            return
        is_blocks_key = isinstance(self.key, BlocksCacheKey)
        if not dst_blocks:  # cache -> cache: the key's slot (a blocks key: the start of each tensor)
            if layout.is_blocks:
                local, remote = _coalesce([(layout.region(self.batch_index), 0, layout.stride)])
                self.kwargs = {"local_runs": local, "remote_runs": remote}
            else:
                layout.region(self.batch_index)
                self.mode = "SLOT_TO_SLOT"
                self.kwargs = {"slot": self.batch_index}
            return
        if not is_blocks_key:
            raise _PlanError("dst_block_indices need a BlocksCacheKey destination, got a CacheKeyByIdAndIndex")
        if src_blocks:  # blocks -> blocks: the engine coalesces and checks block sizes on both sides
            layout.pairs(src_blocks, dst_blocks, block_size)
            self.mode = "BLOCKS_TO_BLOCKS"
            self.kwargs = {"local_blocks": list(src_blocks), "remote_blocks": list(dst_blocks)}
        else:  # cache -> blocks: offsets from the start of each remote tensor
            local, remote = _coalesce(layout.chunks(layout.region(self.batch_index), dst_blocks, block_size or 0))
            self.kwargs = {"local_runs": local, "remote_runs": remote}

    def push_layer(self, transfer_fn: Callable[..., None], src_cache: Any, layer: int) -> None:
        """Push source layer ``layer``; raises ``LLMException`` on failure."""
        if self.error is not None:
            handle_llm_status(LLMStatusCode.LLM_PARAM_INVALID, _OP, self.error)
        first = _TENSORS_PER_LAYER * layer
        if self.raw:
            # One tensor per native call: the peer resolves each absolute address range on its own.
            base = _TENSORS_PER_LAYER * (layer - self.src_range.start)
            for k in range(_TENSORS_PER_LAYER):
                addr = self.dst_addrs[base + k]
                remote = [(addr + off, n) for off, n in self.kwargs["remote_runs"]]
                transfer_fn(_OP, True, None, src_cache, "EXPLICIT", peer=self.dst_cluster_id,
                            local_tensors=[first + k], remote_tensors=[0],
                            local_runs=self.kwargs["local_runs"], remote_runs=remote)
            return
        dst_first = _TENSORS_PER_LAYER * (self.dst_start + layer - self.src_range.start)
        transfer_fn(_OP, True, self.key, src_cache, self.mode,
                    local_tensors=list(range(first, first + _TENSORS_PER_LAYER)),
                    remote_tensors=list(range(dst_first, dst_first + _TENSORS_PER_LAYER)), **self.kwargs)


# ---------------------------------------------------------------------------- the worker


class AsyncTasks:
    """The running ``transfer_cache_async`` jobs of one CacheManager, so that ``finalize`` and
    ``unlink_clusters`` can stop them (llm_datadist_api.md §10.5, docs/compatibility.md). A job is
    here from its start until its thread ends; there are never more than the caller started and
    has not seen end (each job ends at its last layer, at its first failure, or when stopped)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: set[_TransferJob] = set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def _add(self, job: _TransferJob) -> None:
        with self._lock:
            self._jobs.add(job)

    def _discard(self, job: _TransferJob) -> None:
        with self._lock:
            self._jobs.discard(job)

    def stop(self, code: LLMStatusCode, clusters: Sequence[int] | None = None) -> None:
        """Every job's configs to ``clusters`` (None: all) stop: the push of one in flight, if it
        fails, and their next push record ``code`` instead, and the job ends there, as the
        original's loop does at a failure (its later configs stay ``None``)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.stop(code, clusters)

    def resume(self, clusters: Sequence[int]) -> None:
        """Undoes ``stop`` for ``clusters`` (an unlink that did not take the link down)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.resume(clusters)


class _TransferJob(threading.Thread):
    """Runs the layer loop of llm_datadist_api.md §10.5 once. Not a daemon thread, as upstream: the interpreter
    lets an in-flight push finish before the atexit ``finalize``."""

    def __init__(self, transfer_fn: Callable[..., None], src_cache: Any, layer_synchronizer: LayerSynchronizer,
                 targets: list[_Target], num_layers: int, tasks: AsyncTasks | None = None) -> None:
        super().__init__(name="pdlink-transfer-cache-async")
        self._transfer_fn = transfer_fn
        self._src_cache = src_cache
        self._synchronizer = layer_synchronizer
        self._targets = targets
        self._num_layers = num_layers
        self._rets: dict[int, LLMStatusCode] = {}
        self.error: BaseException | None = None
        self._tasks = tasks
        self._stop_lock = threading.Lock()
        self._stop_all: LLMStatusCode | None = None  # finalize
        self._stopped: dict[int, LLMStatusCode] = {}  # dst_cluster_id -> code (unlink_clusters)

    def stop(self, code: LLMStatusCode, clusters: Sequence[int] | None) -> None:
        with self._stop_lock:
            if clusters is None:
                self._stop_all = code
            else:
                for c in clusters:
                    self._stopped[c] = code

    def resume(self, clusters: Sequence[int]) -> None:
        with self._stop_lock:
            for c in clusters:
                self._stopped.pop(c, None)

    def _stop_code(self, cluster: int) -> LLMStatusCode | None:
        with self._stop_lock:
            return self._stop_all if self._stop_all is not None else self._stopped.get(cluster)

    @property
    def num_configs(self) -> int:
        return len(self._targets)

    def results(self) -> list[LLMStatusCode | None]:
        return [self._rets.get(t.dst_cluster_id) for t in self._targets]

    def run(self) -> None:
        try:
            self._transfer_layers()
        except BaseException as e:  # noqa: BLE001 - reported as the timeout code, as upstream
            self.error = e
            logger.error("%s: the transfer thread failed: %s: %s", _OP, type(e).__name__, e)
        finally:
            if self._tasks is not None:
                self._tasks._discard(self)

    def _transfer_layers(self) -> None:
        for layer in range(self._num_layers):
            picked = [t for t in self._targets if layer in t.src_range]
            if not picked:
                logger.debug("%s: src layer %d goes to no destination", _OP, layer)
                continue
            if not self._synchronizer.synchronize_layer(layer, None):
                logger.error("%s: synchronize_layer(%d) returned False; transfer aborted", _OP, layer)
                for t in picked:
                    self._rets[t.dst_cluster_id] = LLMStatusCode.LLM_PARAM_INVALID
                return
            for t in picked:
                stopped = self._stop_code(t.dst_cluster_id)
                if stopped is not None:
                    logger.error("%s: layer %d to cluster %d not transferred: %s", _OP, layer, t.dst_cluster_id,
                                 "the link was unlinked" if stopped == LLMStatusCode.LLM_NOT_YET_LINK
                                 else "the engine was finalized")
                    self._rets[t.dst_cluster_id] = stopped
                    return
                try:
                    t.push_layer(self._transfer_fn, self._src_cache, layer)
                except LLMException as e:
                    logger.error("%s: layer %d to cluster %d failed: %s", _OP, layer, t.dst_cluster_id, e)
                    # a push that the unlink or finalize cut short reports what the next one would
                    stopped = self._stop_code(t.dst_cluster_id)
                    self._rets[t.dst_cluster_id] = stopped if stopped is not None else code_2_status(e.status_code)
                    return
                if layer == t.src_range.stop - 1:
                    self._rets[t.dst_cluster_id] = LLMStatusCode.LLM_SUCCESS
                    logger.info("%s: all layers to cluster %d transferred", _OP, t.dst_cluster_id)


# ---------------------------------------------------------------------------- entry point


def _check_block_indices(name: str, indices: Any) -> None:
    if indices is not None:
        check_list_uint64(name, indices)


def transfer_cache_async(
    transfer_fn: Callable[..., None],
    src_cache: Any,
    src_is_blocks: bool,
    layer_synchronizer: LayerSynchronizer,
    transfer_configs: Sequence[TransferConfigLike],  # must be a list or tuple (checked below)
    src_block_indices: Sequence[int] | None = None,
    dst_block_indices: Sequence[int] | None = None,
    dst_block_memory_size: int | None = None,
    *,
    remote_cache_accessible: bool,
    timeout_code: LLMStatusCode = LLMStatusCode.LLM_TIMEOUT,
    tasks: AsyncTasks | None = None,
) -> CacheTask:
    """Validate (llm_datadist_api.md §10.5), then push ``src_cache`` layer by layer on a new thread.

    * ``transfer_fn``: runs one native transfer, with ``CacheManager._transfer``'s signature
      (``(op, is_push, key, cache, mode, *, slot, local_blocks, remote_blocks, local_tensors,
      remote_tensors, local_runs, remote_runs, peer)``); it must raise ``LLMException`` on failure.
    * ``src_cache``: the caller has type-checked it and refused HOST placement; only its
      ``cache_id`` (inside ``transfer_fn``) and ``cache_desc`` are used. ``src_is_blocks`` says
      whether it is a blocks cache.
    * ``remote_cache_accessible``: configs must all be ``TransferWithCacheKeyConfig`` when True,
      ``TransferConfig`` when False (``TypeError`` otherwise).
    * ``timeout_code``: what ``CacheTask`` answers while the thread runs (v2 ``LLM_TIMEOUT``, v1
      ``LLM_WAIT_PROCESS_TIMEOUT``).
    * ``tasks``: the manager's ``AsyncTasks``, which holds the job while it runs (``finalize`` and
      ``unlink_clusters`` stop it through there).
    """
    # Rules 4-6 and the argument types, in llm_datadist's order.
    _check_block_indices("dst_block_indices", dst_block_indices)
    _check_block_indices("src_block_indices", src_block_indices)
    if dst_block_memory_size is not None:
        check_uint64("dst_block_memory_size", dst_block_memory_size)
    if src_block_indices:
        raise_if_false(dst_block_indices, "transfer from blocks to cache is not supported: "
                       "src_block_indices need dst_block_indices")
        assert dst_block_indices is not None  # raise_if_false above
        raise_if_false(len(src_block_indices) == len(dst_block_indices),
                       "num_block_indices mismatches, src_num = {0}, dst_num = {1}",
                       len(src_block_indices), len(dst_block_indices))
    elif dst_block_indices:
        raise_if_false(dst_block_memory_size is not None,
                       "dst_block_memory_size must be set when transfer from cache to blocks")
    check_isinstance("layer_synchronizer", layer_synchronizer, LayerSynchronizer, allow_none=False)
    if remote_cache_accessible:
        check_isinstance("transfer_configs", transfer_configs, (list, tuple), allow_none=False,
                         inner_types=TransferWithCacheKeyConfig,
                         extra_fmt="While enable_remote_cache_accessible is True, ")
    else:
        check_isinstance("transfer_configs", transfer_configs, (list, tuple), allow_none=False,
                         inner_types=TransferConfig)
    raise_if_false(dst_block_indices or dst_block_memory_size in (None, 0),
                   "dst_block_memory_size ({0}) is neither None nor 0 while dst is not blocks",
                   dst_block_memory_size)
    # Rules 1-3 and the per-config checks.
    desc = src_cache.cache_desc
    raise_if_false(desc.num_tensors % _TENSORS_PER_LAYER == 0,
                   "cache_desc.num_tensors ({0}) is not even", desc.num_tensors)
    num_layers = desc.num_tensors // _TENSORS_PER_LAYER
    targets = []
    for config in transfer_configs:
        target = _Target(config, num_layers)
        if src_block_indices:
            raise_if_false(target.batch_index == 0,
                           "Invalid transfer config, src_batch_index ({0}) != 0 while src is blocks",
                           target.batch_index)
        r = target.src_range
        raise_if_false(0 <= r.start < r.stop <= num_layers,
                       "src_layer_range: {0} out of range, src_layer_num = {1}", r, num_layers)
        if isinstance(config, TransferConfig):  # target.raw
            expected = len(r) * _TENSORS_PER_LAYER
            raise_if_false(len(target.dst_addrs) == expected,
                           "expect {0} dst_addrs, but len(dst_addrs) = {1}, range = {2}",
                           expected, len(target.dst_addrs), r)
        else:
            # [INF] the range setters cannot check this (ranges are set one at a time).
            raise_if_false(len(r) == len(config.dst_layer_range),
                           "src_layer_range {0} and dst_layer_range {1} differ in length",
                           r, config.dst_layer_range)
        targets.append(target)
    layout = _Layout(src_cache, src_is_blocks)
    for target in targets:
        target.plan(layout, list(src_block_indices or ()), list(dst_block_indices or ()), dst_block_memory_size)
    job = _TransferJob(transfer_fn, src_cache, layer_synchronizer, targets, num_layers, tasks)
    if tasks is not None:
        tasks._add(job)
    job.start()
    logger.info("%s: started, %d config(s), %d layer(s)", _OP, len(targets), num_layers)
    return CacheTask(job, timeout_code)
