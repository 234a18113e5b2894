"""Run `--flow-factory-config` over every example YAML of a Flow-Factory checkout (its translation, then diffrl's
parse of the result, with a stand-in --reward) and count what stops it:
`python scripts/flow_factory_survey.py PATH/TO/Flow-Factory` (docs/coming-from-flow-factory.md)."""

import collections
import contextlib
import io
import re
import sys
from pathlib import Path

from diffrl.cli.flow_factory_config import translate_file
from diffrl.cli.main import parse


def main(root: str) -> None:
    files = sorted(Path(root, "examples").rglob("*.yaml"))
    stops, whole = collections.Counter(), 0
    for file in files:
        try:
            translate_file(file)
            with contextlib.redirect_stdout(io.StringIO()):  # its start-up notes
                parse(["train", "--flow-factory-config", str(file), "--reward", "jpeg_compressibility"])
            whole += 1
        except ValueError as err:
            unknown = re.search(r"no diffrl setting for (.*) \(docs", str(err))
            for reason in unknown.group(1).split(", ") if unknown else [str(err).split(": ", 1)[-1][:100]]:
                stops[reason] += 1
    print(f"{whole} of {len(files)} example files translate whole; what stops the others (files):")
    for reason, count in stops.most_common():
        print(f"  {count:3d}  {reason}")


if __name__ == "__main__":
    main(sys.argv[1])
