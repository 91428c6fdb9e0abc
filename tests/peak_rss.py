"""Peak resident memory of one call, for probes run inside worker processes. Run them with
MALLOC_MMAP_THRESHOLD_=1048576: every allocation of 1 MiB or more gets its own mapping,
returned when freed, so the peak counts live tensors, not what malloc kept from earlier
(without it the peak of a model build swung from 16 to 84 MiB between runs)."""
import gc


def rss_peak_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measured(fn, record: dict, key: str):
    """`fn`, wrapped: a first call pages in the code it runs (not the model's bytes) and is
    dropped; record[key] is the second call's peak RSS over what was resident before it
    (record["before_mb"]), from which a probe may measure what comes after too."""
    def probed(*args, **kwargs):
        warm = fn(*args, **kwargs)
        del warm
        gc.collect()
        with open("/proc/self/clear_refs", "w") as fh:  # restart the peak-RSS count here
            fh.write("5")
        record["before_mb"] = rss_peak_mb()
        out = fn(*args, **kwargs)
        record[key] = rss_peak_mb() - record["before_mb"]
        return out
    return probed
