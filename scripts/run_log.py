"""What `hybridgen train --format json` wrote: the step times, the last
step's loss and the closing summary. `bench_gpu.sh` and `ab_gpu.sh` read
their runs with it (lines that are not JSON records, such as warnings, are
skipped)."""
import json


def read(path):
    """(step times in ms, the last step's loss or None, the summary dict)."""
    steps, loss, summary = [], None, {}
    for line in open(path):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "step_ms" in record and "step" in record:
            steps.append(record["step_ms"])
            loss = record.get("loss")
        summary = record.get("summary", summary)
    return steps, loss, summary
