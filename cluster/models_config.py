"""Many models on one cluster: the `models:` list of the config and each model's view.

    models:
      - name: chat                       # the `model` clients send
        path: /models/Llama-3.2-1B-Instruct
        workers: {num_gpus: 1, autoscaling: {min_replicas: 1, max_replicas: 4}}
        lora: {modules: {sql: /adapters/sql}}
      - name: coder
        path: /models/Qwen2.5-Coder-7B
        engine: {max_num_seqs: 64}        # over the top-level engine, key by key
        disaggregation: {prefill: {...}, decode: {...}}

Each model is served as a config of its own, its *view*: the top-level config with the
model's section, its engine (the top-level engine with the model's keys over it), its
workers, disaggregation and lora sections (the top-level ones where it has none) and its
own namespace in Redis (`<key_prefix>:model:<slug>`: the shared routing view, the adapter
registry and the per-key counts of two models never mix). Everything that builds a pool
(cluster/app.py) reads a view, so one model and many are built by the same code. A config
without `models:` is its own one view, unchanged (its deployments keep their names).

A multi-model app names its pools `<role>-<slug>` (worker-chat, prefill-coder, ...); the
slug is the model's name with characters other than letters, digits, `.`, `_`, `-`
replaced by `-`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from cluster.config_errors import ConfigError

if TYPE_CHECKING:
    from cluster.config import KVServeConfig

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
# The roles a pool deployment's name starts with (cluster/app.py's deployment names).
POOL_ROLES = ("worker", "prefill", "decode")


@dataclass(frozen=True)
class ModelView:
    """One served model: its name, its slug (in deployment names and Redis keys), and the
    single-model config that builds its pools. `slug` is "" for a config without `models:`."""

    name: str
    slug: str
    config: KVServeConfig

    def deployment(self, role: str) -> str:
        """The Serve deployment of this model's pool `role` (worker | prefill | decode)."""
        return f"{role}-{self.slug}" if self.slug else role


def slug_of(name: str) -> str:
    return _UNSAFE.sub("-", name).strip("-") or "model"


def model_views(config: KVServeConfig) -> list[ModelView]:
    """The served models, in the config's order (the first one answers a request that
    names no model)."""
    if not config.models:
        return [ModelView(config.model.resolved_name(), "", config)]
    views = []
    for index, entry in enumerate(config.models):
        name = entry.model_section().resolved_name()
        try:
            view = type(config).model_validate(_view_data(config, index))
        except ValidationError as e:
            raise ConfigError(f"models[{index}] ({name}): {_problems(e)}") from None
        views.append(ModelView(name, slug_of(name), view))
    return views


def _problems(error: ValidationError) -> str:
    """A view's validation errors in one line, without the input they were found in (the
    user's own config is quoted by the caller's error)."""
    parts = []
    for e in error.errors(include_input=False):
        where = ".".join(str(part) for part in e["loc"])
        message = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def _view_data(config: KVServeConfig, index: int) -> dict[str, Any]:
    """The dict of model `index`'s view: only what the user set, so that the view is
    validated as the user's own single-model config would be."""
    entry = config.models[index]
    data = config.model_dump(exclude_unset=True, exclude={"models", "model"})
    data["model"] = entry.model_section().model_dump(exclude_none=True)
    if entry.engine is not None:
        data["engine"] = {**data.get("engine", {}), **entry.engine.model_dump(exclude_unset=True)}
    for key in ("workers", "disaggregation", "lora"):
        section = getattr(entry, key)
        if section is not None:
            data[key] = section.model_dump(exclude_unset=True)
    name = entry.model_section().resolved_name()
    data["state"] = {**data.get("state", {}), "key_prefix": f"{config.redis_key_prefix()}:model:{slug_of(name)}"}
    ingress = dict(data.get("ingress", {}))
    ingress.pop("key_models", None)  # the ingress checks them for every model at once
    data["ingress"] = ingress
    return data


def check_models(config: KVServeConfig) -> None:
    """The `models:` list's own rules (each view is checked when it is built): no `model:`
    beside it, names and slugs distinct, no adapter named as a model or as another model's
    adapter, and every model an API key is limited to served."""
    if config.models and "model" in config.model_fields_set:
        raise ValueError("set `model` (one model) or `models` (a list), not both")
    names = ([e.model_section().resolved_name() for e in config.models] if config.models
             else [config.model.resolved_name()])
    _distinct("models: the name", names, "each model needs its own `name`")
    _distinct("models: the deployment slug", [slug_of(n) for n in names],
              "two names differ only in characters a deployment name cannot hold")
    adapters = [a for e in config.models for a in sorted((e.lora or config.lora).modules)]
    _distinct("models: the LoRA adapter", adapters, "an adapter name picks one base model")
    clash = sorted(set(adapters) & set(names))
    if clash:
        raise ValueError(f"models: {clash[0]!r} is both a model and a LoRA adapter")
    for key_id, allowed in config.ingress.key_models.items():
        unknown = sorted(set(allowed) - set(names))
        if unknown:
            raise ValueError(f"ingress.key_models[{key_id!r}]: {unknown[0]!r} is not a served model "
                             f"(served: {', '.join(names)})")
    if config.models:
        try:
            model_views(config)  # each model's view is a config the user could have written
        except ConfigError as e:
            raise ValueError(str(e)) from None


def _distinct(what: str, values: list[str], why: str) -> None:
    seen: set[str] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{what} {value!r} is used twice; {why}")
        seen.add(value)
