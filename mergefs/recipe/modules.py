"""Architecture modules of multimodal models, as mergekit 0.1.5 defines them, for ``modules:``.

A ``modules:`` spec names the parts of a model (``text_decoder``, ``vision_tower``,
``multi_modal_projector``...) by mergekit's architecture definitions: which tensors belong to a
module (its weight prefix, its pre-layer, per-layer and post-layer weights) and which
``config.json`` key holds its layer count. Those definitions are mergekit's data, so this module
reads them from an installed mergekit (``pip install mergekit``) rather than keeping a copy that
would drift; only ``modules:`` specs need it. Pure but for that import; no I/O of sources.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from mergefs.core.errors import SpecError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Weight:
    """One tensor of a module: its name (prefix applied), other names it may be stored under,
    and whether a model may lack it."""

    name: str
    aliases: tuple[str, ...] = ()
    optional: bool = False
    #: names of tensors this one is tied to (loaded in its place when it is absent)
    tied: tuple[str, ...] = ()
    #: the axis indexed by token ids (embeddings, LM heads), or None
    vocabulary_axis: int | None = None

    def find(self, names: Any, tied: bool = False) -> str | None:
        """The name this weight is stored under in a model with tensor ``names`` (``tied``:
        or the name of a tensor it is tied to), or None."""
        for n in (self.name, *self.aliases, *(self.tied if tied else ())):
            if n in names:
                return n
        return None


@dataclass(frozen=True)
class Module:
    pre: tuple[Weight, ...]
    post: tuple[Weight, ...]
    #: the module's weights of layer ``i`` in template order (any ``i``: an output may have
    #: more layers than the model the module was read from)
    layer: Callable[[int], tuple[Weight, ...]]
    #: the model's layer count for this module
    n_layers: int
    #: config.json key (dotted: ``text_config.num_hidden_layers``) of the layer count, or None
    layers_key: str | None


def _weights(infos: Any, prefix: str | None) -> tuple[Weight, ...]:
    p = prefix or ""
    return tuple(Weight(p + w.name, tuple(p + a for a in (w.aliases or ())), bool(w.optional),
                        tuple(p + t for t in (w.tied_names or ())), w.vocabulary_axis)
                 for w in infos)


def _mergekit_config(config: Mapping[str, Any], where: str) -> Any:
    import transformers

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise SpecError(f"{where}: config.json has no model_type; modules: needs it to find "
                        "the model's architecture")
    try:
        cls = transformers.AutoConfig.for_model(model_type).__class__
        return cls.from_dict(dict(config))
    except (ValueError, KeyError) as exc:
        raise SpecError(f"{where}: config.json: transformers does not know model_type "
                        f"{model_type!r} ({exc})") from None


def vocab_size_key(config: Mapping[str, Any], where: str) -> str:
    """The config.json key (dotted) of the vocabulary size of the model whose config is
    ``config``: its architecture's ``vocab_size_config_key`` (``text_config.vocab_size`` for
    Mistral3), else ``vocab_size``, as mergekit reads and writes it."""
    info, _ = _arch_info(config, where)
    return str(getattr(info, "vocab_size_config_key", None) or "vocab_size")


def _arch_info(config: Mapping[str, Any], where: str) -> tuple[Any, Any]:
    """mergekit's architecture definition of the model whose config is ``config``, and the
    config as transformers reads it."""
    try:
        from mergekit.architecture import arch_info_for_config  # type: ignore[import-untyped]
    except ImportError:
        raise SpecError(f"{where}: modules: uses mergekit's architecture definitions to know "
                        "which tensors belong to each module; install them with "
                        "`pip install mergekit`") from None
    cfg = _mergekit_config(config, where)
    archs = getattr(cfg, "architectures", None) or []
    if len(archs) != 1:
        raise SpecError(f"{where}: config.json: modules: needs exactly one entry in "
                        f"'architectures', got {archs!r}")
    info = arch_info_for_config(cfg)
    if info is None:
        raise SpecError(f"{where}: mergekit has no architecture definition for {archs[0]}; "
                        "modules: needs one (use slices: or models: instead)")
    return info, cfg


def read_modules(config: Mapping[str, Any], where: str,
                 only: Collection[str] | None = None) -> dict[str, Module]:
    """The modules of the model whose ``config.json`` is ``config`` (``where`` names it in
    errors), by mergekit's architecture definitions, in their order; the layer counts of the
    modules in ``only`` (None: all) are read, the others' taken as 0 (as mergekit, which reads
    only the modules a config lists)."""
    info, cfg = _arch_info(config, where)
    from mergekit.architecture.base import (  # type: ignore[import-untyped]
        ConfiguredModelArchitecture,
    )

    arch = ConfiguredModelArchitecture(info=info, config=cfg)
    out: dict[str, Module] = {}
    for name, mdef in info.modules.items():
        mod = arch.get_module(name)
        try:
            n = int(mod.num_layers()) if only is None or name in only else 0
        except (RuntimeError, AttributeError, TypeError) as exc:
            raise SpecError(f"{where}: config.json: mergekit cannot read the layer count of "
                            f"module {name} ({str(exc).splitlines()[0][:200]})") from None

        def layer(i: int, mi: Any = mod.info, prefix: str | None = mdef.weight_prefix
                  ) -> tuple[Weight, ...]:
            return _weights(mi.layer_weights(i, cfg) or [], prefix)

        out[name] = Module(
            pre=_weights(mod.info.pre_weights(cfg), mdef.weight_prefix),
            post=_weights(mod.info.post_weights(cfg), mdef.weight_prefix),
            layer=layer, n_layers=n,
            layers_key=mod.info.num_layers_config_key() or None)
    return out


def set_dotted(config: dict[str, Any], key: str, value: Any) -> bool:
    """Set ``a.b.c`` in a nested JSON object in place (copying each level touched); False
    when a level is missing or not an object."""
    parts = key.split(".")
    node = config
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            return False
        node[p] = child = dict(child)
        node = child
    node[parts[-1]] = value
    return True


def architecture_weights(config: Mapping[str, Any], where: str) -> dict[str, Weight]:
    """Every weight of the model whose ``config.json`` is ``config`` by mergekit's architecture
    definition (all modules, the model's own layer counts), by name: what a ``models:`` or
    ``slices:`` spec needs to tell an optional weight (a bias some models lack) from a tensor
    that does not belong. SpecError as :func:`read_modules`."""
    out: dict[str, Weight] = {}
    for mod in read_modules(config, where).values():
        for w in (*mod.pre, *(w for i in range(mod.n_layers) for w in mod.layer(i)),
                  *mod.post):
            out.setdefault(w.name, w)
    return out
