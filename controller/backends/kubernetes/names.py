"""Names and labels of the Kubernetes objects of one run, and the checks the OpenAPI schemas miss.

Called by `manifests.py` (every rendered object is checked before it is returned) and by the tests.
The upstream schemas (kubernetes-validate) check structure and types only; the API server also
rejects names that are not DNS-1123 labels, label values over 63 characters and pod hostnames that do
not fit a label, and it would do so only at submit time. Checking here turns those into a clear
`ValueError` naming the object and the field while the job is compiled.
"""

from __future__ import annotations

import re

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
LABEL_KEY_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
MAX_LABEL = 63

# Labels on every object of a run (the watch and the cleanup select on them).
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "deepfleet"
JOB_ID = "deepfleet.dev/job-id"
ATTEMPT = "deepfleet.dev/attempt"
RUN = "deepfleet.dev/run"
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
# Set by the Job controller on the pods of an Indexed Job (label since 1.28, annotation before).
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
GPU_PRODUCT = "nvidia.com/gpu.product"  # node label set by NVIDIA GPU feature discovery


def check_dns_label(value: str, *, where: str) -> None:
    """Raise ValueError unless `value` is a DNS-1123 label (lowercase alphanumerics and '-', <= 63)."""
    if len(value) > MAX_LABEL or not DNS_LABEL.match(value):
        raise ValueError(f"{where}: {value!r} is not a DNS-1123 label of <= 63 characters; "
                         "use lowercase letters, digits and '-' and shorten metadata.name")


def check_labels(labels: dict[str, str], *, where: str) -> None:
    """Raise ValueError for a label key or value the API server would reject."""
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (prefix and (len(prefix) > 253 or not DNS_SUBDOMAIN.match(prefix))) or len(name) > MAX_LABEL \
                or not LABEL_KEY_NAME.match(name):
            raise ValueError(f"{where}.labels: key {key!r} is not a valid label name; use "
                             "[prefix/]name with letters, digits, '-', '_', '.'")
        if len(value) > MAX_LABEL or not LABEL_VALUE.match(value):
            raise ValueError(f"{where}.labels: {key}={value!r} is not a valid label value; use <= 63 "
                             "letters, digits, '-', '_', '.' starting and ending alphanumeric")


def pod_hostname(job_name: str, index: int) -> str:
    """The hostname the Job controller gives the pod of completion index `index`."""
    return f"{job_name}-{index}"


def rank0_address(job_name: str, service: str, namespace: str) -> str:
    """The stable DNS name of node 0 (its hostname under the headless Service's subdomain)."""
    return f"{pod_hostname(job_name, 0)}.{service}.{namespace}.svc"
