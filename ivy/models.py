"""What Ivy knows about a served model: its tokenizer and prompts (read from the model
directory) and its shape (dimensions, input limit, kind), confirmed by a replica's Info."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import tokenizers

from ivy.chat_template import ChatTemplate
from ivy.errors import ValidationError
from ivy.schemas import TeiToken
from ivy.tokenization import TextTokenizer, load_tokenizer
from protos.trellis.v1 import inference_pb2 as pb

__all__ = [
    "CROSS_ENCODER",
    "EMBEDDING",
    "GENERATOR",
    "OUTPUT_KINDS",
    "ModelSpec",
    "PairTemplate",
    "ServedModel",
    "read_model_spec",
]

EMBEDDING = "embedding"
CROSS_ENCODER = "cross-encoder"
GENERATOR = "generator"

# Output kinds of an Embed call, by name (`trellis.v1.Output`).
OUTPUT_KINDS = {
    "dense": pb.OUTPUT_DENSE,
    "sparse": pb.OUTPUT_SPARSE,
    "multi_vector": pb.OUTPUT_MULTI_VECTOR,
    "token_states": pb.OUTPUT_TOKEN_STATES,
}
_OUTPUT_NAMES = {value: name for name, value in OUTPUT_KINDS.items()}

# other spellings of the two prompts every embedder route knows (Cohere's, E5's)
_PROMPT_ALIASES = {
    "search_query": ("query",),
    "document": ("passage",),
    "passage": ("document",),
    "search_document": ("document", "passage"),
}

_KINDS = {
    pb.MODEL_KIND_EMBEDDING: EMBEDDING,
    pb.MODEL_KIND_CROSS_ENCODER: CROSS_ENCODER,
    pb.MODEL_KIND_GENERATOR: GENERATOR,
}


@dataclass(frozen=True)
class ModelSpec:
    """Model facts; ``from_directory`` guesses, ``with_info`` applies a replica's answer."""

    kind: str
    dimensions: int
    max_input_tokens: int
    query_prompt: str
    document_prompt: str
    vocab_size: int
    confirmed: bool = False
    # a classifier's label names by index (config.json's id2label); () when it has none
    labels: tuple[str, ...] = ()
    # output kinds an embedder offers (`OUTPUT_KINDS` names); a replica's Info says for sure
    outputs: tuple[str, ...] = ("dense",)
    # every sentence-transformers prompt by name (config_sentence_transformers.json's
    # `prompts`), None when the model has no such config; `default_prompt` is the one its
    # `default_prompt_name` names, put before texts sent with no prompt chosen
    prompts: tuple[tuple[str, str], ...] | None = None
    default_prompt: str = ""

    def with_info(self, info: pb.InfoResponse) -> ModelSpec:
        outputs = tuple(_OUTPUT_NAMES[o] for o in info.outputs if o in _OUTPUT_NAMES)
        return replace(
            self,
            kind=_KINDS.get(info.kind, self.kind),
            dimensions=int(info.dimensions) or self.dimensions,
            max_input_tokens=int(info.max_input_tokens) or self.max_input_tokens,
            query_prompt=self.query_prompt or info.query_prompt,
            document_prompt=self.document_prompt or info.document_prompt,
            prompts=self.prompts
            if self.prompts is not None or not (info.query_prompt or info.document_prompt)
            else (("query", info.query_prompt), ("document", info.document_prompt)),
            vocab_size=int(info.vocab_size) or self.vocab_size,
            confirmed=True,
            # An older server lists none: it gives dense vectors only.
            outputs=outputs or ("dense",),
        )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def read_model_spec(directory: Path, vocab_size: int) -> ModelSpec:
    """Read prompts, dimensions and input limit from a Hugging Face model directory."""
    config = _read_json(directory / "config.json")
    st_config = _read_json(directory / "config_sentence_transformers.json")
    sbert = _read_json(directory / "sentence_bert_config.json")
    raw_prompts = st_config.get("prompts")
    prompts = {str(k): str(v) for k, v in raw_prompts.items()} if raw_prompts else {}
    query_prompt = prompts.get("query", "")
    document_prompt = prompts.get("document", prompts.get("passage", ""))
    # sentence-transformers refuses a default name missing from the prompts; so does Ivy
    default_name = st_config.get("default_prompt_name")
    if default_name is not None and default_name not in prompts:
        raise ValueError(
            f"{directory}: default_prompt_name {default_name!r} is not one of the prompts "
            f"{sorted(prompts)} (config_sentence_transformers.json)"
        )
    architectures = " ".join(config.get("architectures") or [])
    if "SequenceClassification" in architectures:
        kind = CROSS_ENCODER
    elif (directory / "modules.json").is_file():
        # sentence-transformers modules make it an encoder whatever the architecture says
        # (Qwen3-Embedding and Qwen3-Reranker name Qwen3ForCausalLM); Info confirms it.
        kind = EMBEDDING
    elif "CausalLM" in architectures:
        kind = GENERATOR
    else:
        kind = EMBEDDING
    max_tokens = int(sbert.get("max_seq_length") or 0)
    if not max_tokens:
        positions = int(config.get("max_position_embeddings") or 512)
        # RoBERTa-style position ids start after the padding index.
        offset = (
            int(config.get("pad_token_id") or 0) + 1
            if config.get("model_type") in ("xlm-roberta", "roberta", "camembert")
            else 0
        )
        max_tokens = positions - offset
    outputs: tuple[str, ...] = ("dense",)
    # DistilBERT calls the width dim, T5 d_model
    dimensions = int(config.get("hidden_size") or config.get("dim") or config.get("d_model") or 0)
    if kind == EMBEDDING:  # a guess until a replica's Info confirms it
        modules = _read_json_any(directory / "modules.json")
        entries = [m for m in (modules if isinstance(modules, list) else []) if isinstance(m, dict)]
        types = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in entries]
        for entry, kind_name in zip(entries, types, strict=True):
            if kind_name == "Dense":  # sentence-transformers Dense layers set the width
                dense = _read_json_any(directory / str(entry.get("path", "")) / "config.json")
                if isinstance(dense, dict) and dense.get("out_features"):
                    dimensions = int(dense["out_features"])
        sparse = (directory / "sparse_linear.pt").is_file() or "SpladePooling" in types
        colbert = (directory / "colbert_linear.pt").is_file()
        outputs += ("sparse",) * sparse + ("multi_vector",) * colbert + ("token_states",)
    id2label = config.get("id2label") or {}
    labels = tuple(str(id2label[k]) for k in sorted(id2label, key=int)) if id2label else ()
    return ModelSpec(
        labels=labels,
        kind=kind,
        dimensions=dimensions,
        max_input_tokens=max_tokens,
        query_prompt=query_prompt,
        document_prompt=document_prompt,
        vocab_size=vocab_size,
        outputs=outputs,
        prompts=tuple(prompts.items()) if prompts else None,
        default_prompt=prompts[default_name] if default_name is not None else "",
    )


def _read_json_any(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@dataclass(frozen=True)
class PairTemplate:
    """How a cross-encoder that declares sentence-transformers' ``message`` modality (the
    causal-LM rerankers, Qwen3-Reranker's shape) reads a (query, document) pair: as the
    messages ``[system: instruction]? query, document`` rendered by its chat template,
    exactly as sentence-transformers' CrossEncoder renders a text pair for such a model."""

    template: ChatTemplate
    add_generation_prompt: bool

    @classmethod
    def from_directory(cls, directory: Path, template: ChatTemplate | None) -> PairTemplate | None:
        sbert = _read_json(directory / "sentence_bert_config.json")
        modalities = sbert.get("modality_config")
        if template is None or not isinstance(modalities, dict) or "message" not in modalities:
            return None
        kwargs = (sbert.get("processing_kwargs") or {}).get("chat_template") or {}
        return cls(template, bool(kwargs.get("add_generation_prompt", False)))

    def messages(self, query: str, document: str, instruction: str | None) -> list[dict[str, str]]:
        system = [{"role": "system", "content": instruction}] if instruction else []
        return [
            *system,
            {"role": "query", "content": query},
            {"role": "document", "content": document},
        ]


@dataclass
class ServedModel:
    """A served model name, its tokenizer, its chat template (chat models) and its
    current spec."""

    name: str
    directory: Path
    tokenizer: TextTokenizer
    spec: ModelSpec
    chat_template: ChatTemplate | None = None

    @classmethod
    def load(cls, name: str, directory: str | Path, word_cache: int | None = None) -> ServedModel:
        """``word_cache``: see :func:`load_tokenizer`."""
        directory = Path(directory)
        tokenizer = load_tokenizer(directory / "tokenizer.json", word_cache)
        return cls(
            name,
            directory,
            tokenizer,
            read_model_spec(directory, tokenizer.vocab_size),
            ChatTemplate.from_directory(directory),
        )

    @functools.cached_property
    def pair_template(self) -> PairTemplate | None:
        """The chat template pairs are rendered with (see `PairTemplate`), or None: pairs
        as the tokenizer builds them."""
        return PairTemplate.from_directory(self.directory, self.chat_template)

    def instructed_prompt(self, instruction: str) -> str:
        """The query prompt with `instruction` in place of the model's own task: a prompt
        whose first line is ``label: task`` followed by more lines (Qwen3-Embedding's
        ``Instruct: <task>\nQuery:``) has a task slot; others refuse an instruction."""
        prompt = self.spec.query_prompt
        first, newline, rest = prompt.partition("\n")
        label, colon, _ = first.partition(": ")
        if not (newline and colon):
            raise ValidationError(
                f"The model `{self.name}` takes no instruction: its query prompt "
                f"{prompt!r} has no `label: task` first line to put one in.",
                param="instruction",
            )
        return f"{label}: {instruction}\n{rest}"

    def prompt_for(self, input_type: str | None) -> str:
        """The prompt an OpenAI-/Cohere-style `input_type` selects: the model's query or
        document prompt (empty where it has none); the default prompt without one."""
        if input_type == "search_query" or input_type == "query":
            return self.spec.query_prompt
        if input_type in ("search_document", "document", "passage"):
            return self.spec.document_prompt
        return self.spec.default_prompt if input_type is None else ""

    @functools.cached_property
    def reference_tokenizer(self) -> tokenizers.Tokenizer:
        """Hugging Face `tokenizers` on the same tokenizer.json, for what the serving
        tokenizer does not do (decoding ids back to text); loaded on first use."""
        return tokenizers.Tokenizer.from_file(str(self.directory / "tokenizer.json"))

    def tei_tokens(self, text: str, add_special_tokens: bool) -> list[TeiToken]:
        """TEI's view of `text`'s encoding (its `into_tokens`): a token under the encoding's
        special-tokens mask (the template's, and special added tokens) shows its own string
        and no span; the others the text they cover, as UTF-8 byte offsets (TEI's
        tokenizer reports bytes, Python's `tokenizers` characters)."""
        enc = self.reference_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        widths = np.fromiter((len(c.encode()) for c in text), dtype=np.int64, count=len(text))
        at = np.concatenate(([0], np.cumsum(widths))).tolist()  # character -> byte offset
        out = []
        for i, token, special, (start, stop) in zip(
            enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets, strict=True
        ):
            if special:
                out.append(TeiToken(i, token, True, None, None))
            else:
                out.append(TeiToken(i, text[start:stop], False, at[start], at[stop]))
        return out

    def decode(
        self, rows: list[list[int]], skip_special_tokens: bool, param: str = "ids"
    ) -> list[str]:
        """Token ids back to text, one string per row (ids outside the vocabulary: a 400
        naming `param`, the request's field for them)."""
        vocab = self.reference_tokenizer.get_vocab_size(with_added_tokens=True)
        for row in rows:
            bad = next((i for i in row if i >= vocab), None)
            if bad is not None:
                raise ValidationError(
                    f"Token id {bad} is outside the vocabulary (size {vocab}).", param=param
                )
        return self.reference_tokenizer.decode_batch(rows, skip_special_tokens=skip_special_tokens)

    def prompt_named(self, name: str | None) -> str:
        """The prompt TEI's ``prompt_name`` selects: the model's sentence-transformers prompt
        of that name (``query`` and ``document`` also answer to Cohere's and E5's spellings);
        with no name the default prompt, as sentence-transformers (and TEI's
        ``--default-prompt-name``) apply it. A name the model lacks is TEI's 400."""
        if name is None:
            return self.spec.default_prompt
        prompts = dict(self.spec.prompts or ())
        for key in (name, *_PROMPT_ALIASES.get(name, ())):
            if key in prompts:
                return prompts[key]
        if not prompts:
            raise ValidationError(
                f"`prompt_name` is `{name}` but the model `{self.name}` has no prompts "
                "(none in its config_sentence_transformers.json).",
                param="prompt_name",
            )
        raise ValidationError(
            f"`prompt_name` is `{name}` but the model `{self.name}` has no prompt of that "
            f"name; its prompts: {', '.join(prompts)}.",
            param="prompt_name",
        )
