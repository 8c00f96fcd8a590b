"""What a saved pipeline folder records about our code, beyond diffusers' own files.

diffusers' generic ``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)`` runs the
loader file that ``model_index.json``'s ``_class_name`` names (``[file stem, class]``); ours
imports the class from the installed sit_vit5 package (no model code travels with the folder).
Each component entry is ``[module, class]``, diffusers writing the class's ``__module__`` and
importing it back (with the base class, e.g. ``SchedulerMixin``, looked up in that module).
Both paths are ``sit_vit5.pipeline``, whichever file of ``sit_vit5.hub`` defines the classes: it
is the path every folder exported so far names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: the file diffusers' generic loader runs (``_class_name`` = [file stem, class] in model_index)
LOADER_FILE = "pipeline.py"
#: the module folders name for our classes (the loader's import, the scheduler's entry): frozen
STABLE_MODULE = "sit_vit5.pipeline"
#: the loader file's text
LOADER_SOURCE = '''"""diffusers' entry point for this folder (written by sit_vit5):
DiffusionPipeline.from_pretrained(folder, trust_remote_code=True) takes SiTPipeline from the
installed sit_vit5 package."""

try:
    from sit_vit5.pipeline import SiTPipeline  # noqa: F401
except ImportError as err:
    raise ImportError("this pipeline folder needs the sit-vit5 package installed (see its README: "
                      "pip install -e <sit-vit5 checkout>)") from err
'''


def loader_entry(class_name: str) -> list[str]:
    """``model_index.json``'s ``_class_name`` for the loader file: ``["pipeline", class_name]``."""
    return [Path(LOADER_FILE).stem, class_name]


def write_loader(folder: str | Path, index_file: str, class_name: str) -> None:
    """Write the loader file into a saved pipeline ``folder``, point ``index_file`` (its
    ``model_index.json``) at it and name our components' module as :data:`STABLE_MODULE`."""
    folder = Path(folder)
    (folder / LOADER_FILE).write_text(LOADER_SOURCE)
    index_path = folder / index_file
    index: dict[str, Any] = json.loads(index_path.read_text())
    index["_class_name"] = loader_entry(class_name)
    for name, entry in index.items():
        # diffusers wrote e.g. ["sit_vit5.hub.scheduler", "SiTScheduler"]: a file that may move
        if isinstance(entry, list) and entry and isinstance(entry[0], str) and \
                entry[0].split(".")[:2] == ["sit_vit5", "hub"]:
            index[name] = [STABLE_MODULE, *entry[1:]]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
