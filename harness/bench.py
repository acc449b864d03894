"""``python -m harness.bench``: ours against HF transformers and our kinds against each other (harness.tools.bench).

A public door: the command and the names users type; the code lives in harness.tools.bench."""

from harness.tools.bench import main  # noqa: F401

if __name__ == "__main__":
    main()
