"""Local model directories, checked before transformers sees them, so that a mistyped path is named as what it is.

Given a path that does not exist, ``from_pretrained`` answers with a Hub error ("Repo id must be in the form ...", or
a failed download), and the reference checks would report the policy's path as a missing *reference*. The policy and
the reference are local directories here (nothing is downloaded at run time): each path is checked first, and the
error says which model it is, which option gave it, and what is wrong with it.

Details: modeling/README.md, "Module notes", ``paths.py``.
"""

from __future__ import annotations

import os

from pair_dpo_trainer.errors import ConfigError


def model_directory_problem(path: str) -> str | None:
    """What is wrong with ``path`` as a local model directory (None when it is one).

    Example:
        >>> model_directory_problem("/no/such/dir")
        'does not exist'
    """
    if not os.path.exists(path):
        return "does not exist"
    if not os.path.isdir(path):
        return "is a file, not a model directory"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return "is a directory without config.json, not a saved model"
    return None


def require_model_directory(path: str, *, role: str, option: str, code: str) -> str:
    """Returns ``path`` when it is a local model directory, else raises naming the model and the option.

    Args:
        path: The directory given by the user.
        role: ``"policy"`` or ``"reference"``.
        option: The option or argument that gave it (``model``, ``--model_name_or_path``, ``ref_model_name_or_path``).
        code: The reason code to raise (``model_not_found`` for the policy, ``reference_not_local`` for the
            reference).

    Raises:
        ConfigError: ``code``, e.g. ``[model_not_found] the policy path '/models/typo' (model) does not exist ...``.
    """
    problem = model_directory_problem(path)
    if problem is None:
        return path
    hub = (
        "; if it is a Hub name: download it first with a pinned revision (hf download REPO --revision SHA "
        "--local-dir DIR), then pass the directory"
        if looks_like_hub_name(path)
        else ""
    )
    raise ConfigError(
        code,
        f"the {role} path {path!r} ({option}) {problem}: check the path; the {role} must be a local directory "
        f"holding config.json and the weights (as save_pretrained writes it){hub}.",
    )


def looks_like_hub_name(path: str) -> bool:
    """True for a missing path shaped like a Hub repository id (``org/name``, or ``name`` alone): nothing here is
    downloaded, so such a name needs the download step spelled out.

    Example:
        >>> looks_like_hub_name("Qwen/Qwen2.5-0.5B"), looks_like_hub_name("/models/my-sft"), looks_like_hub_name("./m")
        (True, False, False)
    """
    parts = path.split("/")
    return (
        not os.path.exists(path)
        and len(parts) <= 2
        and all(parts)
        and not path.startswith((".", "~"))
        and all(part.replace("-", "").replace("_", "").replace(".", "").isalnum() for part in parts)
    )
