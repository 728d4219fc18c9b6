# Sourced by the job scripts beside this file: where the job runs, the rendezvous, and the
# network variables NCCL and NVSHMEM read at init. Every variable can be set before sbatch
# (sbatch passes the submitting shell's environment on) to override what is derived here.
#
#   NNODES          machines in the job (Slurm's SLURM_JOB_NUM_NODES)
#   GPUS_PER_NODE   GPUs per machine, one rank each (SLURM_GPUS_ON_NODE, else 8)
#   HEAD, PORT      the first machine of the job and a free port on it: the rendezvous
#   FABRIC          efa | ib | socket: the inter-machine network (default: detected)
#   STRATEGY        the --sp-strategy of the job scripts (default swiftfusion)

NNODES="${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}"
GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
HEAD="${HEAD:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" | sed -n 1p)}"
PORT="${PORT:-29500}"
STRATEGY="${STRATEGY:-swiftfusion}"
# The topology, stated: detection from hostnames fails where containers share one hostname.
export SWIFTFUSION_TOPOLOGY="${SWIFTFUSION_TOPOLOGY-${NNODES}x${GPUS_PER_NODE}}"
export NNODES GPUS_PER_NODE HEAD PORT STRATEGY
# CPU threads per rank (torchrun sets 1, with a warning, where this is unset).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"

if [ -z "${FABRIC:-}" ]; then  # EFA devices are rdmap*, Mellanox (InfiniBand, RoCE) mlx5_*
    case "$(ls /sys/class/infiniband 2>/dev/null | sed -n 1p)" in
        rdmap*) FABRIC=efa ;;
        mlx5*) FABRIC=ib ;;
        *) FABRIC=socket ;;
    esac
fi
export FABRIC

case "$FABRIC" in
efa)
    # AWS EFA (p4d/p4de: 4 x 100 Gbit/s, p5: 32 x 100 Gbit/s per machine).
    # NCCL reaches EFA through the aws-ofi-nccl plugin (in AWS's Deep Learning AMIs and
    # containers). "AWS Libfabric" makes a missing plugin an error instead of a silent
    # fallback to TCP sockets. With libfabric >= 1.18 and aws-ofi-nccl >= 1.7 nothing else
    # is needed (FI_PROVIDER, FI_EFA_USE_DEVICE_RDMA, NCCL_PROTO are for older stacks).
    export NCCL_NET="${NCCL_NET:-AWS Libfabric}"
    # Set FI_EFA_USE_HUGE_PAGE=0 if fork() fails with "Cannot allocate memory".
    # NVSHMEM: EFA goes through libfabric (the default remote transport is InfiniBand verbs).
    export NVSHMEM_REMOTE_TRANSPORT="${NVSHMEM_REMOTE_TRANSPORT:-libfabric}"
    export NVSHMEM_LIBFABRIC_PROVIDER="${NVSHMEM_LIBFABRIC_PROVIDER:-efa}"
    ;;
ib)
    # InfiniBand (or RoCE on ConnectX): NCCL and NVSHMEM use IB verbs by default
    # (NVSHMEM_REMOTE_TRANSPORT=ibrc). Name the HCAs where a machine has some that must not
    # carry the job (storage NICs): NCCL_IB_HCA=mlx5_0,mlx5_1,... On RoCE, the GID index of
    # RoCE v2 is often 3: NCCL_IB_GID_INDEX=3.
    # NVSHMEM picks the NIC nearest each GPU; pin it where that detection gets it wrong
    # (check with NVSHMEM_DEBUG=INFO): NVSHMEM_ENABLE_NIC_PE_MAPPING=1 and
    # NVSHMEM_HCA_PE_MAPPING=mlx5_0:1:2,mlx5_1:1:2,... (HCA:port:PEs per HCA).
    export NVSHMEM_REMOTE_TRANSPORT="${NVSHMEM_REMOTE_TRANSPORT:-ibrc}"
    ;;
socket)
    # No RDMA NIC found: NCCL falls back to TCP sockets, NVSHMEM has no remote transport.
    # The one-sided strategy needs one across machines: run --sp-strategy torus here.
    echo "env.sh: no EFA or InfiniBand device under /sys/class/infiniband: NCCL uses TCP" \
         "sockets; set FABRIC=efa or FABRIC=ib if that is wrong" >&2
    ;;
*)
    echo "env.sh: FABRIC must be efa, ib or socket (got '$FABRIC')" >&2
    exit 2
    ;;
esac
# The interface of the rendezvous and of NCCL's bootstrap: any but loopback and containers'.
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker,veth}"
# NVSHMEM's symmetric heap per GPU (default 1 GiB): about 75 MB for FLUX.1 at 4096 px on
# 4 x 8 GPUs; raise it for long videos or large batches (docs/cluster.md#symmetric-memory).
# export NVSHMEM_SYMMETRIC_SIZE=2G
# First run on a new cluster: NCCL_DEBUG=INFO shows the network NCCL chose ("NET/OFI" or
# "NET/IB"), NVSHMEM_DEBUG=INFO the transport and NIC of every PE.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

# One torchrun per machine (one Slurm task each, every GPU of the machine visible to it);
# torchrun starts GPUS_PER_NODE ranks there, each with LOCAL_RANK = its GPU. The c10d
# rendezvous on HEAD numbers the machines; each machine's ranks are contiguous (node-major),
# the order the topology-aware mesh expects. Arguments: what torchrun runs.
sf_torchrun() {
    srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
        torchrun --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE" \
        --rdzv-backend=c10d --rdzv-endpoint="$HEAD:$PORT" --rdzv-id="${SLURM_JOB_ID:-0}" \
        "$@"
}

echo "job ${SLURM_JOB_ID:-?}: $NNODES machines x $GPUS_PER_NODE GPUs (topology" \
     "${SWIFTFUSION_TOPOLOGY:-detected}), rendezvous $HEAD:$PORT, network $FABRIC, strategy $STRATEGY"
