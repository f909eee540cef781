"""JSON schemas for the KEDA objects in infra/k8s (KEDA 2.x, `keda.sh/v1alpha1`), written from
the fields of KEDA's ScaledObject and TriggerAuthentication CRDs and the aws-sqs-queue scaler's
documented metadata. kubernetes-validate bundles Kubernetes' own schemas only, so these stand in
for the CRDs: unknown fields are refused (a typo never passes), required ones enforced.
"""

from __future__ import annotations

from typing import Any

_OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,
}

_COUNT = {"type": "integer", "minimum": 0}
_NUMBER_TEXT = {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?$"}
_BOOL_TEXT = {"type": "string", "enum": ["true", "false"]}


def _resource(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A `keda.sh/v1alpha1` object of `kind` whose spec follows `spec`."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": kind},
            "metadata": _OBJECT_META,
            "spec": spec,
        },
        "additionalProperties": False,
    }


# aws-sqs-queue scaler metadata: every value is a string (the CRD's metadata is map[string]string)
AWS_SQS_METADATA: dict[str, Any] = {
    "type": "object",
    "required": ["awsRegion"],
    "anyOf": [{"required": ["queueURL"]}, {"required": ["queueURLFromEnv"]}],
    "properties": {
        "queueURL": {"type": "string", "pattern": "^https://sqs\\.[a-z0-9-]+\\.amazonaws\\.com/"},
        "queueURLFromEnv": {"type": "string"},
        "queueLength": _NUMBER_TEXT,
        "activationQueueLength": _NUMBER_TEXT,
        "awsRegion": {"type": "string", "pattern": "^[a-z]{2}(-[a-z]+)+-[0-9]$"},
        "awsEndpoint": {"type": "string"},
        "scaleOnInFlight": _BOOL_TEXT,
        "scaleOnDelayed": _BOOL_TEXT,
        "identityOwner": {"type": "string", "enum": ["pod", "operator"]},
    },
    "additionalProperties": False,
}

_TRIGGER = {
    "type": "object",
    "required": ["type", "metadata"],
    "properties": {
        "type": {"type": "string"},
        "name": {"type": "string"},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "authenticationRef": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
            },
            "additionalProperties": False,
        },
        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
        "useCachedMetrics": {"type": "boolean"},
    },
    "additionalProperties": False,
    "if": {"properties": {"type": {"const": "aws-sqs-queue"}}},
    "then": {"properties": {"metadata": AWS_SQS_METADATA}},
}

SCALED_OBJECT = _resource(
    "ScaledObject",
    {
        "type": "object",
        "required": ["scaleTargetRef", "triggers"],
        "properties": {
            "scaleTargetRef": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "envSourceContainerName": {"type": "string"},
                },
                "additionalProperties": False,
            },
            "pollingInterval": _COUNT,
            "cooldownPeriod": _COUNT,
            "initialCooldownPeriod": _COUNT,
            "idleReplicaCount": _COUNT,
            "minReplicaCount": _COUNT,
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "fallback": {
                "type": "object",
                "required": ["failureThreshold", "replicas"],
                "properties": {
                    "failureThreshold": _COUNT,
                    "replicas": _COUNT,
                    "behavior": {"type": "string"},
                },
                "additionalProperties": False,
            },
            "advanced": {"type": "object"},
            "triggers": {"type": "array", "minItems": 1, "items": _TRIGGER},
        },
        "additionalProperties": False,
    },
)

TRIGGER_AUTHENTICATION = _resource(
    "TriggerAuthentication",
    {
        "type": "object",
        "minProperties": 1,
        "properties": {
            "podIdentity": {
                "type": "object",
                "required": ["provider"],
                "properties": {
                    "provider": {
                        "enum": ["none", "azure-workload", "gcp", "aws", "aws-eks"],
                    },
                    "identityOwner": {"enum": ["keda", "workload"]},
                    "roleArn": {"type": "string", "pattern": "^arn:aws[a-z-]*:iam::"},
                    "identityId": {"type": "string"},
                    "identityTenantId": {"type": "string"},
                    "identityAuthorityHost": {"type": "string"},
                },
                "additionalProperties": False,
                # KEDA: roleArn and identityOwner are mutually exclusive
                "not": {"required": ["roleArn", "identityOwner"]},
            },
            "secretTargetRef": {"type": "array"},
            "env": {"type": "array"},
            "configMapTargetRef": {"type": "array"},
            "hashiCorpVault": {"type": "object"},
            "azureKeyVault": {"type": "object"},
            "awsSecretManager": {"type": "object"},
            "gcpSecretManager": {"type": "object"},
        },
        "additionalProperties": False,
    },
)

SCHEMAS: dict[str, dict[str, Any]] = {
    "ScaledObject": SCALED_OBJECT,
    "TriggerAuthentication": TRIGGER_AUTHENTICATION,
}
