from specsplit.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerSampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "acceptance_method", "posterior_threshold", "posterior_alpha")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_METHOD_FIELD_NUMBER: _ClassVar[int]
    POSTERIOR_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    POSTERIOR_ALPHA_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    acceptance_method: _common_pb2.AcceptanceMethod
    posterior_threshold: float
    posterior_alpha: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., acceptance_method: _Optional[_Union[_common_pb2.AcceptanceMethod, str]] = ..., posterior_threshold: _Optional[float] = ..., posterior_alpha: _Optional[float] = ...) -> None: ...

class ItemStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class DraftPrefillItem(_message.Message):
    __slots__ = ("handle", "token_ids", "sampling")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    handle: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: WorkerSampling
    def __init__(self, handle: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ...) -> None: ...

class DraftPrefillRequest(_message.Message):
    __slots__ = ("items", "traceparents")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DraftPrefillItem]
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[_Union[DraftPrefillItem, _Mapping]]] = ..., traceparents: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftPrefillResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DraftPrefillResult]
    def __init__(self, results: _Optional[_Iterable[_Union[DraftPrefillResult, _Mapping]]] = ...) -> None: ...

class DraftPrefillResult(_message.Message):
    __slots__ = ("status", "num_cached")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    status: ItemStatus
    num_cached: int
    def __init__(self, status: _Optional[_Union[ItemStatus, _Mapping]] = ..., num_cached: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("handles", "cached_lens", "delta_lens", "delta_token_ids", "ks", "traceparents")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    CACHED_LENS_FIELD_NUMBER: _ClassVar[int]
    DELTA_LENS_FIELD_NUMBER: _ClassVar[int]
    DELTA_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[str]
    cached_lens: _containers.RepeatedScalarFieldContainer[int]
    delta_lens: _containers.RepeatedScalarFieldContainer[int]
    delta_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ks: _containers.RepeatedScalarFieldContainer[int]
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, handles: _Optional[_Iterable[str]] = ..., cached_lens: _Optional[_Iterable[int]] = ..., delta_lens: _Optional[_Iterable[int]] = ..., delta_token_ids: _Optional[_Iterable[int]] = ..., ks: _Optional[_Iterable[int]] = ..., traceparents: _Optional[_Iterable[str]] = ...) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("index", "status")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    index: int
    status: ItemStatus
    def __init__(self, index: _Optional[int] = ..., status: _Optional[_Union[ItemStatus, _Mapping]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("errors", "counts", "token_ids", "supports", "q_token_ids", "q_probs", "num_cached")
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_FIELD_NUMBER: _ClassVar[int]
    Q_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    errors: _containers.RepeatedCompositeFieldContainer[ItemError]
    counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    supports: _containers.RepeatedScalarFieldContainer[int]
    q_token_ids: bytes
    q_probs: bytes
    num_cached: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, errors: _Optional[_Iterable[_Union[ItemError, _Mapping]]] = ..., counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., supports: _Optional[_Iterable[int]] = ..., q_token_ids: _Optional[bytes] = ..., q_probs: _Optional[bytes] = ..., num_cached: _Optional[_Iterable[int]] = ...) -> None: ...

class TargetPrefillItem(_message.Message):
    __slots__ = ("handle", "token_ids", "sampling", "logprobs")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    handle: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: WorkerSampling
    logprobs: int
    def __init__(self, handle: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ..., logprobs: _Optional[int] = ...) -> None: ...

class TargetPrefillRequest(_message.Message):
    __slots__ = ("items", "traceparents")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TargetPrefillItem]
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[_Union[TargetPrefillItem, _Mapping]]] = ..., traceparents: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("handles", "cached_lens", "delta_lens", "delta_token_ids", "draft_counts", "draft_token_ids", "supports", "q_token_ids", "q_probs", "logprobs", "bonus_guesses", "traceparents", "decode_ahead")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    CACHED_LENS_FIELD_NUMBER: _ClassVar[int]
    DELTA_LENS_FIELD_NUMBER: _ClassVar[int]
    DELTA_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_FIELD_NUMBER: _ClassVar[int]
    Q_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BONUS_GUESSES_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[str]
    cached_lens: _containers.RepeatedScalarFieldContainer[int]
    delta_lens: _containers.RepeatedScalarFieldContainer[int]
    delta_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_counts: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    supports: _containers.RepeatedScalarFieldContainer[int]
    q_token_ids: bytes
    q_probs: bytes
    logprobs: _containers.RepeatedScalarFieldContainer[int]
    bonus_guesses: _containers.RepeatedScalarFieldContainer[int]
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    decode_ahead: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, handles: _Optional[_Iterable[str]] = ..., cached_lens: _Optional[_Iterable[int]] = ..., delta_lens: _Optional[_Iterable[int]] = ..., delta_token_ids: _Optional[_Iterable[int]] = ..., draft_counts: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., supports: _Optional[_Iterable[int]] = ..., q_token_ids: _Optional[bytes] = ..., q_probs: _Optional[bytes] = ..., logprobs: _Optional[_Iterable[int]] = ..., bonus_guesses: _Optional[_Iterable[int]] = ..., traceparents: _Optional[_Iterable[str]] = ..., decode_ahead: _Optional[_Iterable[bool]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("errors", "num_accepted", "counts", "token_ids", "num_cached", "logprobs", "acceptance_methods")
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_METHODS_FIELD_NUMBER: _ClassVar[int]
    errors: _containers.RepeatedCompositeFieldContainer[ItemError]
    num_accepted: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    acceptance_methods: _containers.RepeatedScalarFieldContainer[_common_pb2.AcceptanceMethod]
    def __init__(self, errors: _Optional[_Iterable[_Union[ItemError, _Mapping]]] = ..., num_accepted: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_cached: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., acceptance_methods: _Optional[_Iterable[_Union[_common_pb2.AcceptanceMethod, str]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("handles",)
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, handles: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("role", "model", "vocab_size", "max_model_len", "kv_blocks_total", "kv_blocks_used", "block_size", "sequences", "queue_depth", "eos_token_ids", "model_path", "sequences_prefilled", "proposer", "tensor_parallel_size", "batch_invariant", "round_port", "round_channel_prefills", "synthetic_acceptance")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_PREFILLED_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    ROUND_PORT_FIELD_NUMBER: _ClassVar[int]
    ROUND_CHANNEL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    SYNTHETIC_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    vocab_size: int
    max_model_len: int
    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    sequences: int
    queue_depth: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    model_path: str
    sequences_prefilled: int
    proposer: str
    tensor_parallel_size: int
    batch_invariant: bool
    round_port: int
    round_channel_prefills: bool
    synthetic_acceptance: float
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., block_size: _Optional[int] = ..., sequences: _Optional[int] = ..., queue_depth: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., model_path: _Optional[str] = ..., sequences_prefilled: _Optional[int] = ..., proposer: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., batch_invariant: _Optional[bool] = ..., round_port: _Optional[int] = ..., round_channel_prefills: _Optional[bool] = ..., synthetic_acceptance: _Optional[float] = ...) -> None: ...
