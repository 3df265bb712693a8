"""Orbax checkpoints of the whole run state, and immutable policy exports.

Run checkpoints (`RunCheckpointer`): one Orbax `CheckpointManager` step holds
- `state`: the `TrainState` pytree (parameters, optimiser state, step, PRNG
  key, policy version), sharded as it lives on the mesh;
- `data_iter`: the grain iterator's position (grain's own Orbax handler);
- `meta`: JSON with the run config, model config, tokenizer / chat-template
  identities and anything else the caller adds (buffer cursors, ...), and a
  fingerprint of every array of the state (`fingerprint`), checked on restore:
  a step whose values do not read back as saved counts as unreadable.
Saves are asynchronous; the last `keep` steps are kept. A save cut short by a
crash leaves an Orbax temporary directory, removed when the next run opens the
directory; `restore_latest_readable` falls back over steps that do not read back.

Policy exports (`export_policy`, `load_policy`): parameters only (optionally
cast to bfloat16), one directory per policy version under a root, with a
`versions.json` registry. Exporting a version again (a resumed run reaching it
anew) replaces it: the new one is written beside it and swapped in, so a crash
at any point leaves a whole export under the version. Readers restore onto any
mesh: they pass the shapes and shardings they want and Orbax reshards on read.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import uuid
import warnings
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from jaxagent.errors import NonFiniteUpdate, RunWriteFailed, disk_hint
from jaxagent.models.params import Params, cast_params

REGISTRY = "versions.json"
# Beside a version directory while it is exported again: the new export, then the old one.
STAGING, ASIDE = ".new", ".old"
ORBAX_TMP = ".orbax-checkpoint-tmp"  # Orbax's name for a save not yet finalised
UNREADABLE = ".unreadable"  # a run checkpoint that did not read back, kept for a look
UNRECORDED = ".unrecorded"  # one past the steps the run's records hold (resume.restore)


def _quiet_read_records() -> None:
  """Drops for good the records of Orbax's reads that failed (`_DropReadNoise`), logged as
  their tasks are let go, during a read or after it."""
  for name in ("asyncio", "absl"):
    logger = logging.getLogger(name)
    if not any(isinstance(f, _DropReadNoise) for f in logger.filters):
      logger.filters.insert(0, _DropReadNoise())  # (before those that cut a text short)


_HOOK_SWAP = threading.Lock()  # (two swapping at once restored a silent hook for good)


@contextlib.contextmanager
def _quiet_abandoned_reads():
  """Drops what Python would print for Orbax's array reads abandoned when one fails
  ("Exception ignored in: <coroutine ...>" with a traceback each, "coroutine ... was
  never awaited", their tasks' records): the failure is reported once, in one line, by
  the caller."""
  _quiet_read_records()
  try:
    yield
  finally:
    with _HOOK_SWAP:
      previous = sys.unraisablehook
      sys.unraisablehook = lambda unraisable: None
      try:
        with warnings.catch_warnings():  # "coroutine ... was never awaited", one a read
          warnings.simplefilter("ignore", RuntimeWarning)
          gc.collect()  # the abandoned coroutines go now, while the hook is quiet
      finally:
        sys.unraisablehook = previous


class _DropReadNoise(logging.Filter):
  """Drops the records of Orbax's reads that failed (their tasks' exceptions never
  retrieved, the metadata it could not read: the caller says the failure in one line);
  any other goes on (a server logs on in its other threads while an update loads)."""

  def filter(self, record) -> bool:
    try:
      text = record.getMessage()
    except Exception:  # (a record whose arguments do not format: not this one's to drop)
      return True
    return not (("never retrieved" in text and any(  # (a task's or a future's)
        mark in text for mark in ("async_deserialize", "_wrap_awaitable", "OCDBT",
                                  "tensorstore")))
        or text.startswith("Failed to get item metadata"))


# -- fingerprints -----------------------------------------------------------------------

def _bits_sum(x: jax.Array) -> jax.Array:
  """A uint32 sum of `x`'s bits, each element weighted by an odd number drawn from its
  position: any one flipped bit, or two elements swapped, changes it. Computed where
  the array lives (no reshape: a sharded array is reduced shard by shard)."""
  import jax.numpy as jnp
  from jax import lax

  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  index, stride = jnp.zeros(x.shape, jnp.uint32), 1
  for d in reversed(range(x.ndim)):
    index = index + lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride % 2**32)
    stride *= x.shape[d]
  weight = (index * jnp.uint32(2654435761)) | jnp.uint32(1)
  return jnp.sum(bits * weight, dtype=jnp.uint32)


def _finite(x: jax.Array) -> jax.Array:
  import jax.numpy as jnp

  return (jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.floating)
          else jnp.bool_(True))


_fingerprints = jax.jit(lambda tree: (jax.tree.map(_bits_sum, tree),
                                      jax.tree.map(_finite, tree)))


def fingerprint(tree: Any, finite: Optional[list] = None) -> dict[str, list]:
  """{array's path: [the sum of its bits (`_bits_sum`), its dtype]} for every array of
  `tree` (every process of a run computes the same, together). `finite`: a list the
  paths of arrays holding a value that is not finite are added to (the same pass)."""
  sums, oks = jax.device_get(_fingerprints(tree))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  if finite is not None:
    finite += [path for path, ok in zip(paths, jax.tree.leaves(oks)) if not ok]
  return {path: [int(v), str(x.dtype)]
          for path, v, x in zip(paths, jax.tree.leaves(sums), jax.tree.leaves(tree))}


def state_prints(state: Any, step: int) -> dict[str, list]:
  """The fingerprint a checkpoint of `state` at `step` keeps (what its arrays hold,
  checked when they are read back: Orbax keeps no checksum, and a flipped bit read back
  as another number, a damaged checkpoint taken for a good one: red team 15). Raises
  `NonFiniteUpdate` for a state holding a value that is not finite (the weights are
  checked every step; the optimiser's state here, in the same pass: a state that
  cannot be resumed is never saved as one)."""
  bad: list = []
  prints = fingerprint(state, bad)
  if bad:
    raise NonFiniteUpdate(f"the state of step {step} holds values that are not finite "
                          f"(state{bad[0]}): not checkpointed")
  return prints


def fingerprint_mismatch(tree: Any, saved: dict) -> Optional[str]:
  """The first array of `tree` whose values differ from those `saved` (`fingerprint`
  at the save) said, or None. Arrays read as another dtype are not compared (a run
  that changed one is told by its own checks)."""
  for key, (now, dtype) in fingerprint(tree).items():
    was = saved.get(key)
    if was is not None and was[1] == dtype and int(was[0]) != now:
      return key
  return None


class OtherModel(ValueError):
  """A policy export holds another model's weights than the config's (a server started
  with another model than the run's: 409 at its /update_weights)."""


class CheckpointUnreadable(RuntimeError):
  """No run checkpoint reads back."""


def short_reason(e: BaseException, limit: int = 120) -> str:
  """An exception in one short line: the type and the start of the first line of the
  error it came from (the innermost, which names the file or array at fault)."""
  while (e.__cause__ or e.__context__) is not None:
    e = e.__cause__ or e.__context__
  lines = str(e).strip().splitlines()
  text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
  return text if len(text) <= limit else text[:limit - 3] + "..."


# TensorStore's whole spec, which its errors quote (a kilobyte of escaped JSON each)
# (its quoted string, in a message or a repr's escaped quotes, and no further)
_TENSORSTORE_SPEC = re.compile(r"\s*\[tensorstore_spec=(\\?)'.*?\1'\]", re.S)
ORBAX_MESSAGE_CHARS = 300  # an Orbax error record's message, at most, once its spec is cut


class _OrbaxErrorsInOneLine(logging.Filter):
  """Orbax's background save threads log a failed save from each thread with its
  traceback (hundreds of lines for one full disk, above the one line the run says,
  `CheckpointFailed`): its error records keep their message, without the traceback,
  TensorStore's spec or more than ORBAX_MESSAGE_CHARS characters. So do asyncio's
  records of Orbax's own tasks whose failure nobody awaited ("Task exception was never
  retrieved", a traceback and the spec again: a full disk in a new user's round)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR:
      return True
    orbax = f"{os.sep}orbax{os.sep}"
    if orbax in record.pathname or (record.name == "asyncio" and orbax in str(record.msg)):
      message = _TENSORSTORE_SPEC.sub("", record.getMessage())
      if len(message) > ORBAX_MESSAGE_CHARS:  # (its start, and its end: the cause)
        message = (f"{message[:ORBAX_MESSAGE_CHARS // 3]} ... {message[-ORBAX_MESSAGE_CHARS // 2:]}"
                   f" ({len(message)} characters)")
      record.msg, record.args = message, None
      record.exc_info = record.exc_text = record.stack_info = None
    return True


def quiet_failed_save_noise() -> None:
  """Orbax's failed saves are said by the run in one line: its error records (and
  asyncio's of its tasks) are kept to their messages, cut short (the process's absl and
  asyncio log filters; once)."""
  for name in ("absl", "asyncio"):
    logger = logging.getLogger(name)
    if not any(isinstance(f, _OrbaxErrorsInOneLine) for f in logger.filters):
      logger.addFilter(_OrbaxErrorsInOneLine())
  if not getattr(sys.unraisablehook, "jaxagent_quiet", False):
    sys.unraisablehook = _quiet_closed_loop_callbacks(sys.unraisablehook)


def _quiet_closed_loop_callbacks(previous):
  """An unraisable hook that drops TensorStore's completions of a failed save's writes
  handed to Orbax's event loop after it closed (`call_soon_threadsafe`: "Event loop is
  closed", a traceback each, dozens for one full disk above the run's one line); any
  other goes to `previous`."""
  def hook(unraisable) -> None:
    tb, exc = unraisable.exc_traceback, unraisable.exc_value
    while tb is not None and tb.tb_next is not None:
      tb = tb.tb_next
    if (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
        and unraisable.object is None and tb is not None
        and tb.tb_frame.f_code.co_name.endswith("_check_closed")):
      return  # (asyncio's loop, or uvloop's, "uvloop.loop.Loop._check_closed")
    previous(unraisable)

  hook.jaxagent_quiet = True
  return hook


def end_command(code: int) -> None:
  """Ends a command (`python -m ...`) with `code`. After a failed read, what Orbax left
  running (TensorStore's callbacks into a closed event loop, abandoned array reads) printed
  tracebacks and whole TensorStore specs at the interpreter's exit, after the command's one
  line (red team 25): a failed command ends without that exit, and so does one that
  leaves calls running (`jaxagent.pools.end_process`)."""
  from jaxagent.pools import busy_calls, end_process

  if busy_calls():
    end_process(code, os.path.basename(sys.argv[0]) or "the command")
  if code:
    for stream in (sys.stdout, sys.stderr):
      with contextlib.suppress(Exception):
        stream.flush()
    os._exit(code)
  sys.exit(code)


class CheckpointFailed(RunWriteFailed):
  """A checkpoint could not be written (a full disk, a lost mount): the run must stop,
  since it would go on training what it cannot save."""


class IteratorAt:
  """A data iterator's state as it was at one instant, saved as grain saves an
  iterator's (`RunCheckpointer.save`'s `data_iter`; restored into the iterator itself).
  A checkpoint's tasks in flight and its iterator's place must be one instant's: read at
  the save, after its awaits (the canary episodes, the records' sync), the iterator was
  past a group started meanwhile that the tasks in flight did not list, and a resume
  never played it (a reviewer)."""

  def __init__(self, iterator: Any):
    self.state = iterator.get_state()

  def get_state(self) -> bytes:
    """The state as grain's handler writes an iterator's that is no dataset iterator's
    (bytes of JSON: a dataset iterator's restores from the same text)."""
    if isinstance(self.state, bytes):
      return self.state
    return json.dumps(self.state, indent=4).encode()


class RunCheckpointer:
  """Saves and restores the run state, data-iterator position and metadata together."""

  def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=async_save,
                                             cleanup_tmp_directories=True))
    self._started: Optional[int] = None  # the step of the save last started
    self.failed: Optional[CheckpointFailed] = None

  def _failure(self, step: Optional[int], e: BaseException,
               before: Optional[int] = None) -> CheckpointFailed:
    hint = disk_hint(e)
    which = f"step {step}" if step is not None else "a checkpoint"
    if before is not None and before != step:
      which += f" (or step {before}'s, written meanwhile)"
    self.failed = CheckpointFailed(f"checkpoint {which} could not be written in "
                                   f"{self.directory} ({short_reason(e)}){hint}")
    return self.failed

  def check(self) -> None:
    """Raises CheckpointFailed if the save under way (asynchronous) has failed."""
    try:
      self.manager.check_for_errors()
    except Exception as e:
      raise self._failure(self._started, e) from None

  def save(self, step: int, state: Any, meta: dict, data_iter: Any = None,
           force: bool = False, prints: Optional[dict] = None) -> bool:
    """Starts saving `state` (asynchronously); returns whether a save was started.
    CheckpointFailed when it, or the save before it, cannot be written. `prints`:
    `state_prints(state)`, when the caller took them already (off its event loop)."""
    import grain

    self.check()
    meta = {**meta, "fingerprint": state_prints(state, step) if prints is None else prints}
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    if data_iter is not None:
      items["data_iter"] = grain.checkpoint.CheckpointSave(data_iter)
    try:
      started = self.manager.save(step, args=ocp.args.Composite(**items), force=force)
    except Exception as e:  # (Orbax raises the save before's error here too)
      raise self._failure(step, e, before=self._started) from None
    if started:
      self._started = step
    return started

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def saved_processes(self) -> Optional[int]:
    """How many processes saved the newest checkpoint (its metadata's mesh); None when
    it does not say (unreadable: its restore says why)."""
    try:
      return int(self.saved_meta()["mesh"]["processes"])
    except (ValueError, KeyError, TypeError):
      return None

  def saved_meta(self, step: Optional[int] = None) -> Optional[dict]:
    """The metadata a checkpoint (the newest by default) was saved with, read without its
    arrays; None when it does not read (its restore says why)."""
    step = self.latest_step() if step is None else step
    try:
      with open(os.path.join(self.directory, str(step), "meta", "metadata")) as f:
        meta = json.load(f)
      return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
      return None

  def restore(self, abstract_state: Any, data_iter: Any = None, step: Optional[int] = None
              ) -> tuple[Any, dict]:
    """Restores onto `abstract_state`'s shapes and shardings; `data_iter` is set in place.
    Raises ValueError where the values read back are not those saved."""
    state, meta, saved = self._read(abstract_state, data_iter, step)
    self.check_fingerprint(state, saved)
    return state, meta

  def _read(self, abstract_state: Any, data_iter: Any = None, step: Optional[int] = None
            ) -> tuple[Any, dict, dict]:
    """The step's state, its metadata and the fingerprint saved with it, unchecked."""
    import grain

    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    items = {"state": ocp.args.StandardRestore(abstract_state), "meta": ocp.args.JsonRestore()}
    if data_iter is not None:
      items["data_iter"] = grain.checkpoint.CheckpointRestore(data_iter)
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    meta = dict(out["meta"])
    return out["state"], meta, meta.pop("fingerprint", None) or {}

  @staticmethod
  def check_fingerprint(state: Any, saved: dict) -> None:
    """Raises ValueError when `state`'s values are not those saved (`saved`: their
    fingerprint). A reduction over the arrays: every process runs it together."""
    damaged = fingerprint_mismatch(state, saved)
    if damaged is not None:
      raise ValueError(f"damaged: their fingerprint differs, values read back are not "
                       f"those saved (state{damaged})")

  def restore_latest_readable(self, abstract_state: Any, data_iter: Any = None
                              ) -> tuple[Any, dict, list[tuple[int, str]]]:
    """Restores the newest step that reads back; returns `(state, meta, skipped)`.

    `skipped` lists the newer steps that did not read back, newest first, as
    `(step, reason)` with the reason in one short line. They are moved aside
    (`<step>.unreadable`) so that the run can save those steps again. Raises
    `CheckpointUnreadable` when no step reads back (and then moves nothing).
    Every process must call it: a step counts as read only if it read on all.
    """
    from jaxagent import distributed

    skipped = []
    for step in sorted(self.all_steps(), reverse=True):
      try:
        with _quiet_abandoned_reads():
          state, meta, saved = self._read(abstract_state, data_iter, step)
        reason = None
      except Exception as e:  # any failure to read it: a cut file, bad JSON, a missing array
        reason = short_reason(e)
      # Read on every process before its fingerprint is checked: the check is a
      # collective, and a process whose read failed went to this agreement while the
      # others were in the check's reduction (a reviewer: a hang, not the next step).
      if not distributed.agree_max(reason is not None):
        try:
          self.check_fingerprint(state, saved)
        except ValueError as e:
          reason = short_reason(e)
        if not distributed.agree_max(reason is not None):
          break
      skipped.append((step, reason or "unreadable on another process"))
    else:
      detail = "; ".join(f"step {s}: {r}" for s, r in skipped) or "none saved"
      raise CheckpointUnreadable(f"no readable checkpoint in {self.directory} ({detail})")
    if skipped:
      self.set_aside([s for s, _ in skipped], UNREADABLE)
    return state, meta, skipped

  def set_aside(self, steps: list[int], suffix: str) -> None:
    """Moves the checkpoints of `steps` aside (`<step><suffix>`, an older copy of the
    same step replaced), so that the run can save those steps again. Every process
    must call it."""
    from jaxagent import distributed

    if distributed.is_primary():
      for s in steps:
        aside = os.path.join(self.directory, f"{s}{suffix}")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(os.path.join(self.directory, str(s)), aside)
    distributed.barrier("checkpoint-set-aside")
    self.manager.reload()

  def wait(self) -> None:
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      raise self._failure(self._started, e) from None

  def close(self) -> None:
    try:
      self.wait()
    finally:
      with contextlib.suppress(Exception):  # (a failed save's error is raised above)
        self.manager.close()


# -- policy exports -------------------------------------------------------------------


def version_dir(root: str, version: int) -> str:
  return os.path.join(os.path.abspath(root), f"v{int(version):08d}")


def version_of_dir(path: str) -> Optional[int]:
  """The version a version directory's name says (`.../v00000007`: 7); None for any
  other name."""
  m = re.fullmatch(r"v(\d+)", os.path.basename(os.path.normpath(path)))
  return None if m is None else int(m.group(1))


def existing_export(path: str) -> str:
  """`path` where it exists; else the version directory it names with its version
  unpadded (`RUN_DIR/policy/v973` for `v00000973`: `--policy .../v973` was "no such
  export", a new user); else FileNotFoundError, naming the versions its folder holds."""
  if os.path.exists(path):
    return path
  parent, version = os.path.dirname(os.path.normpath(path)) or ".", version_of_dir(path)
  if version is not None and export_stands(version_dir(parent, version)):
    return version_dir(parent, version)  # (standing as the copy a crash left aside too)
  try:
    have = sorted(v for v in map(version_of_dir, os.listdir(parent)) if v is not None)
  except OSError:  # (not there, or not to be listed)
    have = []
  said = ", ".join(map(str, have)) if len(have) <= 6 else (
      f"{', '.join(map(str, have[:3]))}, ..., {', '.join(map(str, have[-3:]))}")
  raise FileNotFoundError(f"no such export {path}" + (
      f" ({parent} holds versions {said}: v{have[-1]} is the latest)" if have else ""))


def list_versions(root: str) -> list[dict]:
  """The registry's entries (version, path, dtype, time), oldest first."""
  path = os.path.join(root, REGISTRY)
  if not os.path.exists(path):
    return []
  try:
    with open(path) as f:
      versions = json.load(f)["versions"]
    if not (isinstance(versions, list) and all(
        isinstance(v, dict) and isinstance(v.get("version"), int) for v in versions)):
      raise ValueError("its versions are not a list of entries with a version number")
  except (ValueError, KeyError, TypeError) as e:  # (the error named no file)
    raise ValueError(f"the policy registry {path} cannot be read "
                     f"({type(e).__name__}: {e})") from None
  return versions


def _write_registry(root: str, versions: list[dict]) -> None:
  tmp = os.path.join(root, REGISTRY + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"versions": sorted(versions, key=lambda v: v["version"])}, f, indent=1)
  os.replace(tmp, os.path.join(root, REGISTRY))  # atomic: readers never see half a registry


def _tidy(root: str) -> None:
  """Finishes or undoes what a crash left of an export under `root`: a staging or
  unfinalised directory is removed; an old export set aside goes back if nothing took
  its place, else it is removed."""
  for name in os.listdir(root):
    path = os.path.join(root, name)
    if ORBAX_TMP in name or name.endswith(STAGING):
      shutil.rmtree(path, ignore_errors=True)
    elif name.endswith(ASIDE):
      target = path[:-len(ASIDE)]
      if os.path.exists(target):
        shutil.rmtree(path, ignore_errors=True)
      else:
        os.rename(path, target)


def export_id(path: str) -> Optional[str]:
  """The id of the export at version directory `path` (its registry's entry beside
  it); None where it has none (an export from before ids, no registry)."""
  version = version_of_dir(path)
  if version is None:
    return None
  try:
    entries = list_versions(os.path.dirname(os.path.abspath(path)))
  except (OSError, ValueError, KeyError):
    return None
  return next((e.get("id") for e in entries if e.get("version") == version), None)


def latest_version(root: str) -> Optional[int]:
  versions = list_versions(root)
  return versions[-1]["version"] if versions else None


def export_policy(root: str, version: int, params: Params, dtype: Optional[str] = "bfloat16",
                  extra: Optional[dict] = None) -> str:
  """Writes `params` as policy `version` under `root` and registers it; returns the
  directory.

  An existing export of the version is replaced: the new one is written to
  `<dir>.new`, the old one renamed to `<dir>.old`, the new one renamed in and the
  old one removed. A crash in between leaves a whole export under one of the names:
  `load_policy` reads `<dir>.old` while `<dir>` is missing, and the next export
  under `root` tidies up.
  """
  from jaxagent import distributed

  path = version_dir(root, version)
  staging, aside = path + STAGING, path + ASIDE
  primary = distributed.is_primary()
  if primary:
    os.makedirs(root, exist_ok=True)
    _tidy(root)
  # Every process of a multi-process run writes its shards; all wait for the tidy-up.
  distributed.barrier(f"export-policy-{version}")
  if dtype is not None:
    params = cast_params(params, dtype)
  t0 = time.time()
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(staging, params)
    ckptr.wait_until_finished()
  distributed.barrier(f"export-policy-{version}-written")
  if primary:  # process 0 alone swaps the export in and keeps the registry
    if os.path.exists(path):
      os.rename(path, aside)
      os.rename(staging, path)
      shutil.rmtree(aside)
    else:
      os.rename(staging, path)
    # `id`: this export's own, which no other (another run's of the same version, this
    # version exported again) has: what a server says it serves (`export_id`).
    entry = {"version": int(version), "path": path, "dtype": dtype or "as-trained",
             "time": time.time(), "save_s": round(time.time() - t0, 4),
             "id": uuid.uuid4().hex, **(extra or {})}
    _write_registry(root, [v for v in list_versions(root) if v["version"] != int(version)]
                    + [entry])
  # No process returns before it is in place: every one may load it next (a resumed
  # process loaded it while process 0 was still renaming it in)
  distributed.barrier(f"export-policy-{version}-done")
  return path


def drop_version(root: str, version: int) -> None:
  """Unregisters and removes the export of `version` (one made only for servers to load,
  once they have a newer one). Process 0 alone calls it."""
  _write_registry(root, [v for v in list_versions(root) if v["version"] != int(version)])
  shutil.rmtree(version_dir(root, version), ignore_errors=True)


class PolicyExports:
  """A run's policy exports (`RUN_DIR/policy/vN`). The versions kept: every
  `export_every`-th and the last (`steps`). With remote servers every version is
  exported for them to load; one not kept (`transient`) is removed once the servers
  have the next (a run kept every one: ~0.5 GB a step for a 135M model, until the disk
  filled)."""

  def __init__(self, root: str, dtype: Optional[str], export_every: int, steps: int):
    self.root, self.dtype = root, dtype  # (dtype None: the parameters' own)
    self.every, self.steps = export_every, steps
    self.exported: Optional[int] = None  # the policy version last exported
    self.transient: Optional[int] = None  # an export not kept, the servers' until the next

  def kept(self, version: int) -> bool:
    return bool(self.every and version % self.every == 0) or version >= self.steps

  def write(self, version: int, params: Params) -> str:
    """Exports `params` as `version`; returns its directory."""
    path = export_policy(self.root, version, params, dtype=self.dtype)
    self.exported = version
    return path

  def served(self, version: int, primary: bool) -> None:
    """The servers now serve `version`, exported for them: the transient export before
    it goes (process 0 removes it), and this one is transient unless it is kept."""
    if self.transient is not None and self.transient != version and primary:
      drop_version(self.root, self.transient)
    self.transient = None if self.kept(version) else version


def drop_versions_after(root: str, version: int) -> list[int]:
  """Unregisters and removes the exports newer than `version` (what a resumed run
  abandons), registered or not; returns their versions. Process 0 alone calls it."""
  if not os.path.isdir(root):
    return []
  _tidy(root)
  versions = list_versions(root)
  if any(v["version"] > version for v in versions):
    _write_registry(root, [v for v in versions if v["version"] <= version])
  dropped = []
  for name in sorted(os.listdir(root)):
    v = version_of_dir(name)
    if v is not None and v > version:
      shutil.rmtree(os.path.join(root, name))
      dropped.append(v)
  return dropped


def export_stands(path: str) -> bool:
  """Whether the policy export `path` can be loaded: its directory, or the one a crash
  left aside while replacing it (`load_policy` reads that)."""
  return os.path.isdir(path) or os.path.isdir(path + ASIDE)


def load_policy(path: str, abstract_params: Any) -> Params:
  """Restores an exported policy onto `abstract_params`.

  `abstract_params`: a pytree of `jax.ShapeDtypeStruct` with the shardings (and
  dtypes) the reader wants, which need not match the writer's mesh.
  """
  path = os.path.abspath(path)
  if not os.path.isdir(path) and os.path.isdir(path + ASIDE):
    path += ASIDE  # a crash cut a replacement short: the previous export stands
  if not os.path.isdir(path):
    raise FileNotFoundError(f"no exported policy at {path}")
  # (a damaged export's failed reads printed 60-140 lines of Orbax's, TensorStore's and
  # asyncio's tracebacks above the one line: a red team)
  quiet_failed_save_noise()
  _quiet_read_records()
  with ocp.StandardCheckpointer() as ckptr:
    try:
      stored = ckptr.metadata(path).item_metadata
    except Exception:  # (unreadable: the restore says why)
      stored = None
    differ = shape_differences(stored, abstract_params) if stored is not None else []
    if differ:  # (Orbax said "set strict=False", advice that would load it wrongly)
      raise OtherModel(f"the policy export at {path} holds another model's weights than "
                       f"the config's ({'; '.join(differ)}): give the run's own config "
                       "(--config), or export the model it trained")
    try:
      return ckptr.restore(path, abstract_params)
    except Exception as e:  # (a traceback of Orbax's, or TensorStore's spec dump)
      reason = short_reason(e)
  with _quiet_abandoned_reads():  # (the failed read's abandoned coroutines, collected)
    pass
  raise ValueError(f"the policy export at {path} cannot be read (damaged or partial: "
                   f"{reason})")


def shape_differences(stored: Any, wanted: Any, limit: int = 3) -> list[str]:
  """`name: stored (a, b), wanted (c, d)` for arrays of two trees (a checkpoint's
  metadata, abstract arrays) whose shapes differ or that one tree has alone; the first
  `limit`."""
  def shapes(tree):
    return {jax.tree_util.keystr(k): tuple(getattr(x, "shape", ()) or ())
            for k, x in jax.tree_util.tree_flatten_with_path(tree)[0]}

  have, want = shapes(stored), shapes(wanted)
  out = [f"{k}: stored {have.get(k, 'none')}, wanted {want.get(k, 'none')}"
         for k in sorted(have.keys() | want.keys()) if have.get(k) != want.get(k)]
  return out[:limit] + ([f"{len(out) - limit} more"] if len(out) > limit else [])


def abstract_params_like(params_or_shapes: Any, shardings: Any, dtype=None) -> Any:
  """ShapeDtypeStructs of `params_or_shapes` with `shardings` (and optionally `dtype`)."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s),
      params_or_shapes, shardings)
