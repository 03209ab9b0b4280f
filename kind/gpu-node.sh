#!/usr/bin/env bash
# Runs INSIDE a kind GPU worker node (`kvlab cluster create --gpu` copies it there with docker cp
# and runs it with docker exec), the steps NVIDIA's nvkind performs on each node:
# install the NVIDIA container toolkit in the node, register the `nvidia` runtime with the node's
# containerd (the RuntimeClass `nvidia` points at it), and stop the driver from re-creating
# device nodes the node should not see. Idempotent: a second run changes nothing.
set -euo pipefail

if ! command -v nvidia-ctk >/dev/null; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends curl gpg ca-certificates >/dev/null
  curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey \
    | gpg --dearmor --yes -o /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
  curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list \
    | sed 's#deb https://#deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] https://#g' \
    > /etc/apt/sources.list.d/nvidia-container-toolkit.list
  apt-get update -qq
  apt-get install -y -qq nvidia-container-toolkit >/dev/null
fi

# a containerd runtime named `nvidia` (not the default: only pods with runtimeClassName: nvidia use it)
nvidia-ctk runtime configure --runtime=containerd --config-source=command
systemctl restart containerd

# Toolkits before 1.19 mount a tmpfs over /proc/driver/nvidia; expose params with
# ModifyDeviceFiles: 0 instead (1.19+ already does this itself).
if grep -q '^ModifyDeviceFiles: 1' /proc/driver/nvidia/params 2>/dev/null || mountpoint -q /proc/driver/nvidia; then
  umount -R /proc/driver/nvidia 2>/dev/null || true
  if grep -q '^ModifyDeviceFiles: 1' /proc/driver/nvidia/params; then
    cp /proc/driver/nvidia/params /root/gpu-params
    sed -i 's/^ModifyDeviceFiles: 1$/ModifyDeviceFiles: 0/' /root/gpu-params
    mount --bind /root/gpu-params /proc/driver/nvidia/params
  fi
fi

nvidia-smi -L
