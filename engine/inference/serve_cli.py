"""`deepfleet serve CHECKPOINT` (`python -m deepfleet.engine.inference.serve_cli`): try a trained model at once.

The torch-free `deepfleet` CLI (controller/cli.py) runs this module as a subprocess. CHECKPOINT is a
deepfleet training checkpoint (a root with `latest`, or one step directory), a `.safetensors` file, or
a Hugging Face model directory (config.json and weights). The model to load weights into comes from:
- `--model pkg.mod:factory` (the job's factory, e.g. `examples.gpt.factories:build`, called with
  `--model-kwargs` JSON; it may return the module or a ManagedJob-like object with `.model`), or
- `--hf-config DIR` (a Transformers config directory; the model is built from it), or
- CHECKPOINT itself when it is a Hugging Face model directory.
Then init_inference(checkpoint=CHECKPOINT, ...) and the app of `serve.py` under uvicorn. User errors print
one line and exit 2.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Annotated, Any

import typer

EXIT_INVALID_INPUT = 2

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def build_model(checkpoint: Path, *, model: str | None, model_kwargs: str, hf_config: Path | None) -> tuple[Any, Any]:
    """(nn.Module, tokenizer or None) for CHECKPOINT; ValueError naming the option to fix."""
    if model:
        module_name, _, attr = model.partition(":")
        if not attr:
            raise ValueError(f"--model: {model!r} must be 'package.module:factory'")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--model: cannot import {model!r} ({e})") from e
        try:
            kwargs = json.loads(model_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"--model-kwargs: not JSON ({e.msg})") from e
        built = factory(**kwargs)
        return getattr(built, "model", built), None
    config_dir = hf_config or (checkpoint if (checkpoint / "config.json").is_file() else None)
    if config_dir is None:
        raise ValueError("--model: a deepfleet checkpoint holds only tensors; name the model with --model "
                         "pkg.mod:factory (the job's factory) or --hf-config DIR")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    try:
        tokenizer = AutoTokenizer.from_pretrained(config_dir)
    except (OSError, ValueError):
        tokenizer = None
    return built, tokenizer


def weights_path(checkpoint: Path) -> Path:
    if checkpoint.is_dir() and (checkpoint / "config.json").is_file():
        files = sorted(checkpoint.glob("*.safetensors"))
        if len(files) != 1:
            raise ValueError(f"CHECKPOINT: {checkpoint} needs exactly one .safetensors file, found {len(files)}")
        return files[0]
    return checkpoint


@app.command()
def serve(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint root or step directory, .safetensors file or HF model directory.")],
    model: Annotated[str | None, typer.Option(help="The model factory, pkg.mod:function.")] = None,
    model_kwargs: Annotated[str, typer.Option(help="JSON keyword arguments for the factory.")] = "{}",
    hf_config: Annotated[Path | None, typer.Option(help="A Transformers config directory.")] = None,
    dtype: Annotated[str, typer.Option(help="fp32, bf16, fp16 or int8.")] = "fp32",
    quant_bits: Annotated[int | None, typer.Option(help="Weight-only quantization: 8 or 4.")] = None,
    max_batch_size: Annotated[int, typer.Option(help="Sequences decoded together.")] = 16,
    max_out_tokens: Annotated[int, typer.Option(help="Positions per sequence (prompt + output).")] = 1024,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    name: Annotated[str, typer.Option(help="The model name clients send.")] = "deepfleet",
    api_key: Annotated[str | None, typer.Option(
        envvar="DEEPFLEET_SERVE_API_KEY", show_default=False,
        help="Keys clients must send as 'Authorization: Bearer <key>' (comma-separated; prefer the "
             "environment variable: a command line is visible to other users).")] = None,
) -> None:
    """Serve CHECKPOINT at http://HOST:PORT/v1/completions (OpenAI-compatible, streaming)."""
    try:
        built, tokenizer = build_model(checkpoint, model=model, model_kwargs=model_kwargs, hf_config=hf_config)
        from deepfleet.engine.inference.engine import init_inference

        quant = None if quant_bits is None else {"weight": {"num_bits": quant_bits}}
        engine = init_inference(built, dtype=dtype, quant=quant, checkpoint=str(weights_path(checkpoint)),
                                max_batch_size=max_batch_size, max_out_tokens=max_out_tokens)
    except ValueError as e:
        typer.echo(f"error: {str(e).splitlines()[0]}", err=True)
        raise typer.Exit(EXIT_INVALID_INPUT) from None
    import uvicorn

    from deepfleet.engine.inference.serve import api_keys_from, create_app

    app = create_app(engine, model_name=name, tokenizer=tokenizer, api_keys=api_keys_from(api_key))
    uvicorn.run(app, host=host, port=port, log_level="info")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
