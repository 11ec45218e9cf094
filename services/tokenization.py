"""Prompts to token ids: raw completion text, a chat message (through the tokenizer's chat template), or ids."""

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
