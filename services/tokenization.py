"""Prompts to token ids: raw completion text, a chat message (through the tokenizer's chat template), or ids."""

from specsplit.services.errors import InvalidArgument


def encode_prompt(tokenizer, prompt: str | list[int], chat: bool = False) -> list[int]:
    if isinstance(prompt, list):
        return list(prompt)
    if tokenizer is None:
        raise InvalidArgument("this model has no tokenizer: send prompt token ids instead of text")
    if not prompt:
        raise InvalidArgument("prompt must not be empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidArgument("this model's tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer.encode(prompt, add_special_tokens=True)


def encode_prompt_off_loop(tokenizer, prompt: str | list[int], chat: bool = False) -> list[int]:
    """encode_prompt for a worker thread, with the same ids. A fast tokenizer's backend encodes plain text through
    `encode_batch`, which releases the GIL (its `encode` does not), and only the ids are converted to Python (the
    offsets and masks transformers also builds would hold the GIL for a long prompt)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if chat or not isinstance(prompt, str) or not prompt or not hasattr(backend, "encode_batch"):
        return encode_prompt(tokenizer, prompt, chat)
    return backend.encode_batch([prompt], add_special_tokens=True)[0].ids
