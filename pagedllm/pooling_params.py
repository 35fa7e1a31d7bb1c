"""PoolingParams: what a pooling (embedding) request asks of its vector, validated at construction.

vLLM's names and meanings: ``dimensions`` keeps the first ``dimensions`` entries of the embedding
(Matryoshka truncation, before normalization; only for a model whose config says it was trained
for it), ``normalize`` L2-normalizes the vector (None: the model's default, which is on for every
embedding model pagedllm serves, as in vLLM). Invalid values raise ``ValueError`` / ``TypeError``
whose message starts with the field's name. The model-dependent checks (is ``dimensions`` allowed
and in range?) are ``PoolerConfig.verify``'s, run by the engine at ``add_request``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.sampling_params import RequestOutputKind


@dataclass
class PoolingParams:
    dimensions: int | None = None
    normalize: bool | None = None
    # Pooling requests produce one output when they finish (the engine's streams read this).
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None:
            if isinstance(d, bool) or not isinstance(d, int):
                raise TypeError(f"dimensions must be an integer, got {type(d).__name__}")
            if d < 1:
                raise ValueError(f"dimensions must be a positive integer, got {d}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise TypeError(f"normalize must be a bool or None, got {type(self.normalize).__name__}")
        if self.output_kind != RequestOutputKind.FINAL_ONLY:
            raise ValueError("output_kind must be FINAL_ONLY: a pooling request has one output, when it finishes")

    def clone(self) -> PoolingParams:
        """A shallow copy, without re-validating (``copy.copy`` costs several times more, and the
        engine clones once per request)."""
        twin = object.__new__(PoolingParams)
        twin.__dict__.update(self.__dict__)
        return twin


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns its hidden states into a vector, read from its folder at start-up
    (``loader/pooling_config.py``): the pooling type (MEAN / CLS / LAST), whether requests
    normalize by default, the vector's full size and which Matryoshka sizes the model allows
    (``is_matryoshka``: any size; ``matryoshka_dimensions``: those only), as vLLM reads them."""

    pooling_type: str
    normalize: bool
    hidden_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def resolve(self, params: PoolingParams, model_name: str) -> PoolingParams:
        """A copy of ``params`` with ``normalize`` filled in; ValueError naming ``dimensions`` when
        this model cannot shorten its vectors (vLLM's message) or not to that size."""
        d = params.dimensions
        if d is not None:
            if not (self.is_matryoshka or self.matryoshka_dimensions):
                raise ValueError(f"dimensions: model {model_name!r} does not support matryoshka representation, "
                                 "changing output dimensions will lead to poor results")
            if self.matryoshka_dimensions and d not in self.matryoshka_dimensions:
                raise ValueError(f"dimensions: model {model_name!r} only supports {list(self.matryoshka_dimensions)} "
                                 f"matryoshka dimensions, got {d}")
            if d > self.hidden_size:
                raise ValueError(f"dimensions must be <= the model's embedding size ({self.hidden_size}), got {d}")
        resolved = params.clone()
        if resolved.normalize is None:
            resolved.normalize = self.normalize
        return resolved
