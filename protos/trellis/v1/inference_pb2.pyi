from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Pooling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_DEFAULT: _ClassVar[Pooling]
    POOLING_MEAN: _ClassVar[Pooling]
    POOLING_CLS: _ClassVar[Pooling]
    POOLING_LAST_TOKEN: _ClassVar[Pooling]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]

class Normalize(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NORMALIZE_DEFAULT: _ClassVar[Normalize]
    NORMALIZE_ON: _ClassVar[Normalize]
    NORMALIZE_OFF: _ClassVar[Normalize]

class Activation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTIVATION_DEFAULT: _ClassVar[Activation]
    ACTIVATION_NONE: _ClassVar[Activation]
    ACTIVATION_SIGMOID: _ClassVar[Activation]

class Output(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_DENSE: _ClassVar[Output]
    OUTPUT_SPARSE: _ClassVar[Output]
    OUTPUT_MULTI_VECTOR: _ClassVar[Output]
    OUTPUT_TOKEN_STATES: _ClassVar[Output]

class ModelKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_KIND_UNSPECIFIED: _ClassVar[ModelKind]
    MODEL_KIND_EMBEDDING: _ClassVar[ModelKind]
    MODEL_KIND_CROSS_ENCODER: _ClassVar[ModelKind]
    MODEL_KIND_GENERATOR: _ClassVar[ModelKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
POOLING_DEFAULT: Pooling
POOLING_MEAN: Pooling
POOLING_CLS: Pooling
POOLING_LAST_TOKEN: Pooling
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
NORMALIZE_DEFAULT: Normalize
NORMALIZE_ON: Normalize
NORMALIZE_OFF: Normalize
ACTIVATION_DEFAULT: Activation
ACTIVATION_NONE: Activation
ACTIVATION_SIGMOID: Activation
OUTPUT_DENSE: Output
OUTPUT_SPARSE: Output
OUTPUT_MULTI_VECTOR: Output
OUTPUT_TOKEN_STATES: Output
MODEL_KIND_UNSPECIFIED: ModelKind
MODEL_KIND_EMBEDDING: ModelKind
MODEL_KIND_CROSS_ENCODER: ModelKind
MODEL_KIND_GENERATOR: ModelKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class CallRequest(_message.Message):
    __slots__ = ("id", "timeout_ms", "embed", "score", "cancel", "admitted", "traceparent")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    id: int
    timeout_ms: int
    embed: EmbedRequest
    score: ScoreRequest
    cancel: bool
    admitted: bool
    traceparent: str
    def __init__(self, id: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., embed: _Optional[_Union[EmbedRequest, _Mapping]] = ..., score: _Optional[_Union[ScoreRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., admitted: _Optional[bool] = ..., traceparent: _Optional[str] = ...) -> None: ...

class CallResponse(_message.Message):
    __slots__ = ("id", "embed", "score", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    embed: EmbedResponse
    score: ScoreResponse
    error: CallError
    def __init__(self, id: _Optional[int] = ..., embed: _Optional[_Union[EmbedResponse, _Mapping]] = ..., score: _Optional[_Union[ScoreResponse, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("ids", "lengths")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[bytes] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("data", "shape", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_us", "inference_us")
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_US_FIELD_NUMBER: _ClassVar[int]
    queue_us: int
    inference_us: int
    def __init__(self, queue_us: _Optional[int] = ..., inference_us: _Optional[int] = ...) -> None: ...

class SparseVectors(_message.Message):
    __slots__ = ("indices", "values", "counts")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    indices: bytes
    values: bytes
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, indices: _Optional[bytes] = ..., values: _Optional[bytes] = ..., counts: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenVectors(_message.Message):
    __slots__ = ("vectors", "counts")
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    vectors: Tensor
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, vectors: _Optional[_Union[Tensor, _Mapping]] = ..., counts: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "pooling", "normalize", "dimensions", "dtype", "span_counts", "spans", "outputs")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SPAN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    inputs: TokenBatch
    pooling: Pooling
    normalize: Normalize
    dimensions: int
    dtype: DType
    span_counts: _containers.RepeatedScalarFieldContainer[int]
    spans: _containers.RepeatedScalarFieldContainer[int]
    outputs: _containers.RepeatedScalarFieldContainer[Output]
    def __init__(self, inputs: _Optional[_Union[TokenBatch, _Mapping]] = ..., pooling: _Optional[_Union[Pooling, str]] = ..., normalize: _Optional[_Union[Normalize, str]] = ..., dimensions: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., span_counts: _Optional[_Iterable[int]] = ..., spans: _Optional[_Iterable[int]] = ..., outputs: _Optional[_Iterable[_Union[Output, str]]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "prompt_tokens", "timing", "sparse", "multi_vectors", "token_states")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    MULTI_VECTORS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STATES_FIELD_NUMBER: _ClassVar[int]
    embeddings: Tensor
    prompt_tokens: int
    timing: Timing
    sparse: SparseVectors
    multi_vectors: TokenVectors
    token_states: TokenVectors
    def __init__(self, embeddings: _Optional[_Union[Tensor, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., sparse: _Optional[_Union[SparseVectors, _Mapping]] = ..., multi_vectors: _Optional[_Union[TokenVectors, _Mapping]] = ..., token_states: _Optional[_Union[TokenVectors, _Mapping]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("pairs", "first_segment_lengths", "activation")
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEGMENT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    pairs: TokenBatch
    first_segment_lengths: _containers.RepeatedScalarFieldContainer[int]
    activation: Activation
    def __init__(self, pairs: _Optional[_Union[TokenBatch, _Mapping]] = ..., first_segment_lengths: _Optional[_Iterable[int]] = ..., activation: _Optional[_Union[Activation, str]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "prompt_tokens", "timing")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    scores: Tensor
    prompt_tokens: int
    timing: Timing
    def __init__(self, scores: _Optional[_Union[Tensor, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_name", "kind", "dimensions", "max_input_tokens", "vocab_size", "num_labels", "default_pooling", "default_normalize", "query_prompt", "document_prompt", "device", "dtype", "seconds_per_token", "outputs")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LABELS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_POOLING_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    QUERY_PROMPT_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_PROMPT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    kind: ModelKind
    dimensions: int
    max_input_tokens: int
    vocab_size: int
    num_labels: int
    default_pooling: Pooling
    default_normalize: bool
    query_prompt: str
    document_prompt: str
    device: str
    dtype: str
    seconds_per_token: float
    outputs: _containers.RepeatedScalarFieldContainer[Output]
    def __init__(self, model_name: _Optional[str] = ..., kind: _Optional[_Union[ModelKind, str]] = ..., dimensions: _Optional[int] = ..., max_input_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_labels: _Optional[int] = ..., default_pooling: _Optional[_Union[Pooling, str]] = ..., default_normalize: _Optional[bool] = ..., query_prompt: _Optional[str] = ..., document_prompt: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., seconds_per_token: _Optional[float] = ..., outputs: _Optional[_Iterable[_Union[Output, str]]] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "response_format", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "repetition_penalty", "min_p", "min_tokens", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    response_format: ResponseFormat
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    repetition_penalty: float
    min_p: float
    min_tokens: int
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "json_schema")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_TEXT: _ClassVar[ResponseFormat.Type]
        TYPE_JSON_OBJECT: _ClassVar[ResponseFormat.Type]
        TYPE_JSON_SCHEMA: _ClassVar[ResponseFormat.Type]
    TYPE_TEXT: ResponseFormat.Type
    TYPE_JSON_OBJECT: ResponseFormat.Type
    TYPE_JSON_SCHEMA: ResponseFormat.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    type: ResponseFormat.Type
    json_schema: str
    def __init__(self, type: _Optional[_Union[ResponseFormat.Type, str]] = ..., json_schema: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_ids", "sampling")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: bytes
    sampling: SamplingOptions
    def __init__(self, prompt_ids: _Optional[bytes] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ...) -> None: ...

class GenerateUsage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "timing", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: GenerateUsage
    timing: Timing
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[GenerateUsage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...
