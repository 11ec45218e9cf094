"""Prompts to token ids: raw completion text, a chat message (through the tokenizer's chat template), or ids."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

from specsplit.services.errors import InvalidArgument

CHAT_ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 1024
MAX_PROMPT_CHARS = 1 << 20


def encode_prompt(tokenizer, prompt: str | list[int], chat: bool = False) -> list[int]:
    if isinstance(prompt, list):
        return list(prompt)
    if tokenizer is None:
        raise InvalidArgument("this model has no tokenizer: send prompt token ids instead of text")
    if not prompt:
        raise InvalidArgument("prompt must not be empty")
    if chat:
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt, add_special_tokens=True)


def encode_prompt_off_loop(tokenizer, prompt: str | list[int], chat: bool = False) -> list[int]:
    """encode_prompt for a worker thread, with the same ids. A fast tokenizer's backend encodes plain text through
    `encode_batch`, which releases the GIL (its `encode` does not), and only the ids are converted to Python (the
    offsets and masks transformers also builds would hold the GIL for a long prompt)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if chat or not isinstance(prompt, str) or not prompt or not hasattr(backend, "encode_batch"):
        return encode_prompt(tokenizer, prompt, chat)
    return backend.encode_batch([prompt], add_special_tokens=True)[0].ids


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation ({"role", "content"} dicts, roles system/user/assistant) through the chat template, ending
    with the prompt for the assistant's next turn."""
    if tokenizer is None:
        raise InvalidArgument("this model has no tokenizer: send prompt token ids instead of messages")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("this model's tokenizer has no chat template")
    if not messages:
        raise InvalidArgument("messages must not be empty")
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"at most {MAX_MESSAGES} messages")
    for i, message in enumerate(messages):
        if message.get("role") not in CHAT_ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise InvalidArgument(f"messages[{i}].content must be text")
    if sum(len(m["content"]) for m in messages) > MAX_PROMPT_CHARS:
        raise InvalidArgument(f"messages longer than {MAX_PROMPT_CHARS} characters in all")
    ids = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


# Prompts longer than this are tokenized on a thread of their own: a 1M-character prompt takes about a second to
# encode, which on the event loop stalls every other stream; short ones cost less than the hand-off. One thread, so
# a burst of huge prompts queues there and leaves the other cores to the running streams.
TOKENIZE_OFF_LOOP_CHARS = 2048
_TOKENIZER_THREAD = ThreadPoolExecutor(1, thread_name_prefix="tokenize")


async def encode_for_request(tokenizer, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                             chat: bool = False) -> list[int]:
    """A request's prompt ids (from `messages` when given, else `prompt`), long inputs off the event loop."""
    loop = asyncio.get_running_loop()
    if messages:
        if sum(len(m.get("content") or "") for m in messages if isinstance(m, dict)) > TOKENIZE_OFF_LOOP_CHARS:
            return await loop.run_in_executor(_TOKENIZER_THREAD, encode_messages, tokenizer, messages)
        return encode_messages(tokenizer, messages)
    if isinstance(prompt, str) and len(prompt) > TOKENIZE_OFF_LOOP_CHARS:
        return await loop.run_in_executor(_TOKENIZER_THREAD, encode_prompt_off_loop, tokenizer, prompt, chat)
    return encode_prompt(tokenizer, prompt, chat)
