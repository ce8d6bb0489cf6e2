-- Argo CD health check for polyrl RLJobs (resource.customizations.health.polyrl.dev_RLJob).
-- Healthy: Succeeded, or Running with Ready=True. Progressing: pending, admitting, scaling, or the
-- operator has not yet observed the latest spec. Suspended: spec.suspend honoured. Degraded: Failed,
-- or QuotaExceeded (the job cannot get its pods until quota frees up).
local hs = {}

local function condition(status, ctype)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == ctype then
      return c
    end
  end
  return nil
end

local function message_of(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  return fallback
end

if obj.status == nil or obj.status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the polyrl operator to pick up the job"
  return hs
end

local status = obj.status
local phase = status.phase
local generation = obj.metadata and obj.metadata.generation or nil

if phase == "Failed" then
  hs.status = "Degraded"
  hs.message = message_of(condition(status, "Failed"), status.message or "RLJob failed")
  return hs
end

if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = message_of(condition(status, "Succeeded"), "RLJob succeeded")
  return hs
end

local quota = condition(status, "QuotaExceeded")
if quota ~= nil and quota.status == "True" then
  hs.status = "Degraded"
  hs.message = message_of(quota, "Quota exceeded")
  return hs
end

if phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = message_of(condition(status, "Suspended"), "RLJob is suspended")
  return hs
end

if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local ready = condition(status, "Ready")
if phase == "Running" and ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = message_of(ready, "RLJob is running")
  return hs
end

hs.status = "Progressing"
hs.message = message_of(ready, "RLJob is " .. phase)
return hs
