"""pytest ``filterwarnings`` entries for warnings a test means to cause (pyproject.toml turns every warning into an
error)."""

# [Note: steps that keep departing] (offload/runtime/departures.py): tests whose loop departs from its plan step
# after step on purpose (a branch taken every other step, experts chosen per step, chaos in the plan)
DEPARTING = "ignore:offload. . of the last . steps departed from their plan:offload.OffloadWarning"
