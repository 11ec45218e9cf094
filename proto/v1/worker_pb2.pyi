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
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DraftPrefillItem]
    def __init__(self, items: _Optional[_Iterable[_Union[DraftPrefillItem, _Mapping]]] = ...) -> None: ...

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

class ProposeItem(_message.Message):
    __slots__ = ("handle", "cached_len", "delta", "k")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    handle: str
    cached_len: int
    delta: _containers.RepeatedScalarFieldContainer[int]
    k: int
    def __init__(self, handle: _Optional[str] = ..., cached_len: _Optional[int] = ..., delta: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[Proposal]
    def __init__(self, results: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("status", "token_ids", "support", "q_token_ids", "q_probs", "num_cached")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_FIELD_NUMBER: _ClassVar[int]
    Q_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    status: ItemStatus
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    support: int
    q_token_ids: bytes
    q_probs: bytes
    num_cached: int
    def __init__(self, status: _Optional[_Union[ItemStatus, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., support: _Optional[int] = ..., q_token_ids: _Optional[bytes] = ..., q_probs: _Optional[bytes] = ..., num_cached: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TargetPrefillItem]
    def __init__(self, items: _Optional[_Iterable[_Union[TargetPrefillItem, _Mapping]]] = ...) -> None: ...

class VerifyItem(_message.Message):
    __slots__ = ("handle", "cached_len", "delta", "draft_token_ids", "support", "q_token_ids", "q_probs", "logprobs", "bonus_guess")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_FIELD_NUMBER: _ClassVar[int]
    Q_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BONUS_GUESS_FIELD_NUMBER: _ClassVar[int]
    handle: str
    cached_len: int
    delta: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    support: int
    q_token_ids: bytes
    q_probs: bytes
    logprobs: int
    bonus_guess: int
    def __init__(self, handle: _Optional[str] = ..., cached_len: _Optional[int] = ..., delta: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., support: _Optional[int] = ..., q_token_ids: _Optional[bytes] = ..., q_probs: _Optional[bytes] = ..., logprobs: _Optional[int] = ..., bonus_guess: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[Verdict]
    def __init__(self, results: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("status", "num_accepted", "token_ids", "logprobs", "num_cached", "acceptance_method")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_METHOD_FIELD_NUMBER: _ClassVar[int]
    status: ItemStatus
    num_accepted: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    num_cached: int
    acceptance_method: _common_pb2.AcceptanceMethod
    def __init__(self, status: _Optional[_Union[ItemStatus, _Mapping]] = ..., num_accepted: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., num_cached: _Optional[int] = ..., acceptance_method: _Optional[_Union[_common_pb2.AcceptanceMethod, str]] = ...) -> None: ...

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
    __slots__ = ("role", "model", "vocab_size", "max_model_len", "kv_blocks_total", "kv_blocks_used", "block_size", "sequences", "queue_depth", "eos_token_ids", "model_path", "sequences_prefilled", "proposer")
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
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., block_size: _Optional[int] = ..., sequences: _Optional[int] = ..., queue_depth: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., model_path: _Optional[str] = ..., sequences_prefilled: _Optional[int] = ..., proposer: _Optional[str] = ...) -> None: ...
