"""Model references as users write them: local paths, Hugging Face Hub ids and revisions.

The grammar is mergekit's (``mergekit/common.py``, ``ModelReference`` and ``ModelPath``): a string
``PATH[@REVISION][+LORA[@REVISION]]``, or a mapping ``{model: PATH | {path, revision}, lora: ...,
override_architecture: ...}``. :func:`parse_reference` reads either into a :class:`ModelRef`;
:func:`resolve_model` resolves each part (model and LoRA adapter) with :func:`resolve_reference`
into a :class:`Resolved` source, in this order:

1. a local path (relative to the spec's directory) that exists wins, as in mergekit;
2. else a Hub id found in the local Hugging Face cache, in the layout huggingface_hub writes
   (``models--org--name/refs/<branch or tag>`` holding a commit hash,
   ``models--org--name/snapshots/<commit>/`` holding the files, symlinks into ``blobs/``): the
   snapshot directory, read as an ordinary local source. A revision is a branch, a tag, a full
   commit hash or a commit prefix of at least 7 hex digits;
3. else, unless offline, the Hub is asked for the revision's commit and the model is read
   remotely, by planned byte ranges, through huggingface_hub's fsspec filesystem
   (``hf://org/name@<commit>``, opened by :mod:`mergefs.sources.remote`); never downloaded whole;
4. else a one-line :class:`SpecError` naming the id and what was tried.

Library code gets the cache directory and the offline flag as a :class:`HubConfig`;
:meth:`HubConfig.from_environ` is the only code that reads the environment, and only the spec
loader (the edge) calls it. Nothing here runs on the trio thread: it touches the disk and, for a
model not cached, the network.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergefs.core.errors import SpecError

log = logging.getLogger(__name__)

_TRUE = frozenset({"1", "ON", "YES", "TRUE"})
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_PREFIX_RE = re.compile(r"[0-9a-f]{7,39}")
# huggingface_hub's repo id rule (validate_repo_id): [namespace/]name, no "--" or "..".
_REPO_ID_RE = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")
_MAX_REPO_ID = 96


@dataclass(frozen=True)
class HubConfig:
    """Where the Hugging Face cache is and whether the Hub may be asked (no network if not)."""

    cache_dir: Path
    offline: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> HubConfig:
        """huggingface_hub's rules: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
        ``$XDG_CACHE_HOME/huggingface/hub`` or ``~/.cache/huggingface/hub``; offline when
        ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is 1/ON/YES/TRUE."""
        home = environ.get("HF_HOME") or os.path.join(
            environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
            "huggingface")
        cache = (environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE")
                 or os.path.join(home, "hub"))
        flag = environ.get("HF_HUB_OFFLINE") or environ.get("TRANSFORMERS_OFFLINE") or ""
        # absolute: resolved paths are recorded in manifests and replayed from elsewhere
        return cls(Path(os.path.expandvars(cache)).expanduser().absolute(),
                   flag.upper() in _TRUE)


@dataclass(frozen=True)
class ModelPath:
    """A path or Hub id with an optional revision, as written (mergekit's ``ModelPath``)."""

    path: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.path}@{self.revision}" if self.revision else self.path


@dataclass(frozen=True)
class ModelRef:
    """A model reference: a model, and a LoRA adapter to apply to it (``model+lora``)."""

    model: ModelPath
    lora: ModelPath | None = None

    def __str__(self) -> str:
        return f"{self.model}+{self.lora}" if self.lora else str(self.model)


@dataclass(frozen=True)
class Resolved:
    """Where a model reference's bytes are.

    ``path`` is an absolute local path (a directory or file, a cached snapshot included) or a
    URL; ``repo_id`` and ``commit`` are set when a Hub id was resolved (``revision`` is the one
    written, None for the default branch). For ``model+lora``, ``model`` and ``lora`` are the
    two parts and ``path`` is :func:`join_lora` of theirs (opened by :mod:`mergefs.sources.lora`).
    """

    path: str
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None
    model: Resolved | None = None
    lora: Resolved | None = None

    @property
    def plain(self) -> bool:
        """A path or URL as written: nothing to record beyond it."""
        return self.repo_id is None and self.lora is None

    def _path_record(self) -> str | dict[str, Any]:
        if self.repo_id is None:
            return self.path
        return {"path": self.repo_id, "revision": self.commit}

    def record(self) -> str | dict[str, Any]:
        """What a recorded spec holds: the path, or a mapping mergekit also reads, with Hub ids
        pinned to their commit and the path it resolved to (parsing it again resolves the same
        sources: a fixed point)."""
        if self.lora is not None and self.model is not None:
            return {"model": self.model._path_record(), "lora": self.lora._path_record(),
                    "resolved": self.path}
        if self.repo_id is None:
            return self.path
        return {"model": self._path_record(), "resolved": self.path}


def join_lora(model_path: str, adapter_path: str) -> str:
    """The source path of a model with a LoRA adapter: mergekit's ``MODEL+LORA``, resolved
    (the adapter part is always an absolute local path)."""
    return f"{model_path}+{adapter_path}"


def split_lora(path: str) -> tuple[str, str] | None:
    """``(model, adapter)`` of a :func:`join_lora` path; None for any other path (an existing
    local path holding ``+`` included)."""
    k = path.rfind("+/")
    if k <= 0 or ("://" not in path and Path(path).exists()) or not Path(path[k + 1:]).is_dir():
        return None
    return path[:k], path[k + 1 :]


# -- parsing ------------------------------------------------------------------------------------
def _err(where: str, message: str) -> SpecError:
    return SpecError(f"{where}: {message}")


def _parse_path(value: Any, where: str) -> ModelPath:
    if isinstance(value, str):
        if value.count("@") > 1:
            raise _err(where, f"invalid model reference (more than one '@'): {value!r}")
        path, at, rev = value.partition("@")
        if not path or (at and not rev):
            raise _err(where, f"invalid model reference: {value!r}")
        return ModelPath(path, rev or None)
    if isinstance(value, Mapping):
        extra = set(value) - {"path", "revision"}
        if extra:
            raise _err(f"{where}.{sorted(extra)[0]}", "unknown key (a model path has 'path' and "
                       "'revision')")
        given, revision = value.get("path"), value.get("revision")
        if not isinstance(given, str) or not given:
            raise _err(f"{where}.path", f"expected a path or Hub id, got {given!r}")
        if revision is not None and (not isinstance(revision, str) or not revision):
            raise _err(f"{where}.revision", f"expected a branch, tag or commit, got "
                       f"{revision!r}")
        return ModelPath(given, revision)
    raise _err(where, f"expected a path or Hub id, got {value!r}")


def parse_reference(value: Any, where: str) -> ModelRef:
    """Read a model reference as mergekit does: ``'org/name@rev+lora'`` or a mapping.

    Keys of a mapping: ``model`` (required), ``lora``, ``override_architecture`` (refused: not
    supported yet) and ``resolved`` (written by :meth:`Resolved.record`; informational).
    """
    if isinstance(value, str):
        parts = value.split("+")
        if len(parts) > 2 or not all(parts):
            raise _err(where, f"invalid model reference (expected MODEL or MODEL+LORA): "
                       f"{value!r}")
        return ModelRef(_parse_path(parts[0], where),
                        _parse_path(parts[1], where) if len(parts) == 2 else None)
    if isinstance(value, Mapping):
        if "override_architecture" in value:
            raise _err(f"{where}.override_architecture", "not supported yet")
        if "model" not in value:
            raise _err(where, "a model reference mapping needs 'model' (a path or Hub id, or "
                       "{path, revision})")
        extra = set(value) - {"model", "lora", "resolved"}
        if extra:
            raise _err(f"{where}.{sorted(extra)[0]}", "unknown key (a model reference has "
                       "'model' and 'lora')")
        lora = value.get("lora")
        return ModelRef(_parse_path(value["model"], f"{where}.model"),
                        None if lora is None else _parse_path(lora, f"{where}.lora"))
    raise _err(where, f"expected a path or Hub id, got {value!r}")


def looks_like_repo_id(text: str) -> bool:
    """``org/name`` or ``name`` as huggingface_hub accepts them (no ``--``, ``..``, ``./``)."""
    return (len(text) <= _MAX_REPO_ID and _REPO_ID_RE.fullmatch(text) is not None
            and "--" not in text and ".." not in text and not text.endswith((".", "-")))


# -- resolving ----------------------------------------------------------------------------------
def resolve_model(value: Any, base_dir: Path, config: HubConfig, where: str) -> Resolved:
    """Resolve ``base_model`` or ``models[].model`` as written. A URL, or a string naming an
    existing local path (even one holding ``@`` or ``+``), comes back as written, for the
    caller's own checks; anything else is parsed and resolved by :func:`resolve_reference`."""
    if isinstance(value, str) and ("://" in value
                                   or (base_dir / Path(value).expanduser()).exists()):
        return Resolved(value)
    ref = parse_reference(value, where)
    if ref.lora is None:
        if "://" in ref.model.path:
            if ref.model.revision is not None:
                raise _err(where, f"a revision applies to Hub ids, not to the URL "
                           f"{ref.model.path}")
            return Resolved(ref.model.path)
        return resolve_reference(ref.model, base_dir, config, where)
    if "://" in ref.model.path or "://" in ref.lora.path:
        raise _err(where, f"{ref}: model+lora with a URL is not supported yet (give local "
                   "paths or Hub ids)")
    model = resolve_reference(ref.model, base_dir, config, where)
    lora = resolve_reference(ref.lora, base_dir, config, f"{where} (lora)")
    if "://" in lora.path:
        raise _err(where, f"{ref}: LoRA adapter {ref.lora} is not cached locally; reading "
                   "adapters remotely is not supported yet (download it, e.g. "
                   "`huggingface-cli download`)")
    if not Path(lora.path).is_dir():
        raise _err(where, f"{ref}: LoRA adapter {ref.lora}: no such directory {lora.path}")
    return Resolved(join_lora(model.path, lora.path), model=model, lora=lora)


def resolve_reference(ref: ModelPath, base_dir: Path, config: HubConfig, where: str) -> Resolved:
    """Resolve a model path (not a URL): an existing local path, a cached Hub snapshot, or a
    remote Hub model (see the module docstring). A path that is not a Hub id, and a bare
    ``name`` that is not cached, resolve to the local path even if it does not exist (opening
    it says so)."""
    local = (base_dir / Path(ref.path).expanduser()).resolve()
    if local.exists() or not looks_like_repo_id(ref.path):
        if ref.revision is not None:
            log.warning("%s: %s is a local path: revision %s ignored (as mergekit does)", where,
                        local, ref.revision)
        return Resolved(str(local))
    found, tried = find_cached(config.cache_dir, ref.path, ref.revision)
    if found is not None:
        commit, snapshot = found
        log.debug("%s: %s resolved to %s", where, ref, snapshot)
        return Resolved(str(snapshot), ref.path, ref.revision, commit)
    if "/" not in ref.path:  # a bare name is a local path unless it is cached
        return Resolved(str(local))
    head = f"{ref}: no local path {local}, and {tried}"
    if config.offline:
        raise _err(where, f"{head}; offline (HF_HUB_OFFLINE), so the Hub was not asked")
    commit = hub_commit(ref.path, ref.revision, where, head)
    return Resolved(f"hf://{ref.path}@{commit}", ref.path, ref.revision, commit)


def find_cached(cache_dir: Path, repo_id: str, revision: str | None
                ) -> tuple[tuple[str, Path] | None, str]:
    """``((commit, snapshot dir), '')`` for a cached model revision, or ``(None, what was
    missing)``. ``revision`` (default ``main``) is looked up in ``refs/`` (branches, tags),
    then as a commit hash or a unique prefix of one among the snapshots."""
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    if not repo_dir.is_dir():
        return None, f"not in the Hugging Face cache {cache_dir}"
    commit: str | None = None
    ref_file = repo_dir / "refs" / rev
    if ".." not in Path(rev).parts and not Path(rev).is_absolute() and ref_file.is_file():
        commit = ref_file.read_text().strip()
    elif _COMMIT_RE.fullmatch(rev) or _PREFIX_RE.fullmatch(rev):
        snapshots = repo_dir / "snapshots"
        matches = sorted(p.name for p in snapshots.iterdir()
                         if p.name.startswith(rev)) if snapshots.is_dir() else []
        if len(matches) > 1:
            return None, (f"revision {rev} is ambiguous in the cache {cache_dir} "
                          f"({', '.join(m[:12] for m in matches)})")
        commit = matches[0] if matches else None
    if commit is None:
        return None, f"revision {rev} is not in the Hugging Face cache {cache_dir}"
    snapshot = repo_dir / "snapshots" / commit
    if not _COMMIT_RE.fullmatch(commit) or not snapshot.is_dir():
        return None, (f"the cache {cache_dir} has ref {rev} -> {commit[:40]!r} but no such "
                      "snapshot")
    if not any(snapshot.glob("*.safetensors")):  # huggingface_hub downloads files one by one
        return None, (f"its snapshot {commit[:12]} in the Hugging Face cache {cache_dir} has no "
                      ".safetensors weights (a partial download)")
    return (commit, snapshot), ""


def hub_commit(repo_id: str, revision: str | None, where: str, head: str) -> str:
    """Ask the Hub for the commit of ``repo_id@revision`` (the only network call here)."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import (
            GatedRepoError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise _err(where, f"{head}; reading from the Hub needs huggingface_hub") from None
    try:
        info = HfApi().model_info(repo_id, revision=revision, timeout=10)
    except GatedRepoError:
        raise _err(where, f"{head}; the Hub says it is gated: accept its terms and set "
                   "HF_TOKEN") from None
    except RevisionNotFoundError:
        raise _err(where, f"{head}; the Hub has no revision {revision}") from None
    except RepositoryNotFoundError:
        raise _err(where, f"{head}; the Hub has no such model (or it is private: set "
                   "HF_TOKEN)") from None
    except Exception as exc:  # noqa: BLE001 - network failures of every kind: name and stop
        detail = str(exc).splitlines()[0] if str(exc) else ""
        raise _err(where, f"{head}; the Hub is unreachable ({type(exc).__name__}: "
                   f"{detail})") from None
    if not isinstance(info.sha, str) or not _COMMIT_RE.fullmatch(info.sha):
        raise _err(where, f"{head}; the Hub sent no commit for it")
    return info.sha
