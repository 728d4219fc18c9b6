"""Build patches/xfuser-0.7.0-plugin.patch from the installed (pristine, RECORD-checked by
tests/test_patches.py) xfuser 0.7.0 files: python patches/make_plugin_patch.py <out.patch>."""
import difflib
import sys
import sysconfig
from pathlib import Path
SITE = Path(sysconfig.get_paths()["purelib"])
EDITS = {}

def edit(rel, *pairs):
    EDITS.setdefault(rel, []).extend(pairs)

# 1. --sp_strategy / --topology in xFuserArgs (CLI, runner, create_config)
SP_FLAGS = '''

def _add_sp_strategy_args(parser: FlexibleArgumentParser) -> FlexibleArgumentParser:
    """--sp_strategy / --topology (provided by the xfuser-swiftfusion plugin)."""
    group = parser.add_argument_group("Sequence-parallel strategy")
    group.add_argument(
        "--sp_strategy",
        type=str,
        default=None,
        choices=["usp", "tas", "torus", "swiftfusion", "auto"],
        help="Attention strategy for sequence parallelism: usp (default) or a strategy of the "
        "xfuser-swiftfusion plugin. Without --ulysses_degree/--ring_degree the plugin picks "
        "the mesh from --topology and the model's head count.",
    )
    group.add_argument(
        "--topology",
        type=str,
        default=None,
        help="Machines x GPUs per machine, NxM (default: $SWIFTFUSION_TOPOLOGY or detected).",
    )
    return parser


@dataclass
class xFuserArgs:'''
edit("xfuser/config/args.py",
     ("\n\n@dataclass\nclass xFuserArgs:", SP_FLAGS),
     ('''    distilled_transformer_2_path: Optional[str] = None

    def __post_init__(self):''', '''    distilled_transformer_2_path: Optional[str] = None
    # Sequence-parallel strategy (xfuser-swiftfusion)
    sp_strategy: Optional[str] = None
    topology: Optional[str] = None

    def __post_init__(self):'''),
     ('''    def create_config(
        self,
    ) -> Tuple[EngineConfig, InputConfig]:
        self._validate_gemm_quantization_flags()
        if not self.use_ray and not torch.distributed.is_initialized():
            logger.warning(
                "Distributed environment is not initialized. " "Initializing..."
            )
            init_distributed_environment()
''', '''    def create_config(
        self,
    ) -> Tuple[EngineConfig, InputConfig]:
        self._validate_gemm_quantization_flags()
        if not self.use_ray and not torch.distributed.is_initialized():
            logger.warning(
                "Distributed environment is not initialized. " "Initializing..."
            )
            init_distributed_environment()
        if self.sp_strategy:
            # Route USP to the strategy and build the groups for its mesh (and degrees).
            from xfuser_swiftfusion.integrations.xfuser import route_sp_strategy

            self.ulysses_degree, self.ring_degree = route_sp_strategy(self)
'''))

def patch_return_parser(text):
    # both add_cli_args and add_runner_args end with "        return parser"
    return text.replace("\n        return parser\n", "\n        return _add_sp_strategy_args(parser)\n")

# 2. xdit: processes from --topology when --sp_strategy has no degrees
edit("xfuser/cli.py",
     ('''    if torchrun_values["--nproc_per_node"] is None:
        torchrun_values["--nproc_per_node"] = str(get_nproc_from_args(runner_args))
''', '''    if torchrun_values["--nproc_per_node"] is None:
        nproc = get_nproc_from_args(runner_args)
        if any(a.startswith(("--sp_strategy", "--sp-strategy")) for a in runner_args):
            from xfuser_swiftfusion.integrations.xfuser import PluginError, xdit_nproc
            try:
                nproc = xdit_nproc(runner_args + ["--nnodes", torchrun_values["--nnodes"]], nproc)
            except (PluginError, ValueError) as e:
                sys.exit(f"xdit: error: {e}")
        torchrun_values["--nproc_per_node"] = str(nproc)
'''))

# 3. USP dispatch to a registered strategy (replaces rebinding USP in every module)
edit("xfuser/model_executor/layers/usp.py",
     ('''def USP(
        query: torch.Tensor,''', '''# A sequence-parallel strategy with USP's signature that handles the calls it supports
# (xfuser-swiftfusion's use_strategy sets it; None: USP itself).
_SP_STRATEGY = None


def set_sp_strategy(strategy) -> None:
    """Route every USP call to ``strategy`` (same signature), or back to USP with None."""
    global _SP_STRATEGY
    _SP_STRATEGY = strategy


def USP(
        query: torch.Tensor,'''),
     ('''    if combine_qkv_a2a is None:
        combine_qkv_a2a = False
    _validate_gqa_params(''', '''    if _SP_STRATEGY is not None:
        return _SP_STRATEGY(
            query, key, value, dropout_p, is_causal, joint_query, joint_key, joint_value,
            joint_strategy, attn_layer, combine_qkv_a2a, backend, attention_kwargs,
            head_balance_layer, kv_head_repeat,
        )
    if combine_qkv_a2a is None:
        combine_qkv_a2a = False
    _validate_gqa_params('''))

# 4. Flux runner wrapper: bug 1 (missing _pad_to_sp_divisible; padding attended) and
#    bug 2 (text not divisible by SP: replicated text K/V counted once per rank)
edit("xfuser/model_executor/models/transformers/transformer_flux.py",
     ('''        uses_pipeline_parallelism = get_runtime_state().num_pipeline_patch > 1
        if not uses_pipeline_parallelism:
            hidden_states = USP(
                query, key, value, combine_qkv_a2a=True, attn_layer=attn
            )
            hidden_states = hidden_states.transpose(1, 2)''', '''        uses_pipeline_parallelism = get_runtime_state().num_pipeline_patch > 1
        if not uses_pipeline_parallelism and get_runtime_state().split_text_embed_in_sp:
            hidden_states = USP(
                query, key, value, combine_qkv_a2a=True, attn_layer=attn
            )
            hidden_states = hidden_states.transpose(1, 2)
        elif not uses_pipeline_parallelism:
            # Text is replicated on every rank (its length is not divisible by the SP
            # degree): attend to it once, as joint tokens in front of the image tokens.
            text = num_encoder_hidden_states_tokens
            hidden_states = USP(
                query[:, :, text:],
                key[:, :, text:],
                value[:, :, text:],
                joint_query=query[:, :, :text],
                joint_key=key[:, :, :text],
                joint_value=value[:, :, :text],
                joint_strategy="front",
                attn_layer=attn,
            )
            hidden_states = hidden_states.transpose(1, 2)'''),
     ('''        if padding_length > 0:
            hidden_states = self._pad_to_sp_divisible(hidden_states, padding_length, dim=1)
            img_ids = self._pad_to_sp_divisible(img_ids, padding_length, dim=0)''', '''        if padding_length > 0:
            # Zero padding would be attended to by every query (there is no key mask here).
            raise ValueError(
                f"{sequence_length} image tokens are not divisible by the sequence parallel "
                f"degree {sp_world_size}; choose height and width so that "
                f"(height/16)*(width/16) is a multiple of {sp_world_size}"
            )'''),
     ('''        if encoder_hidden_states.shape[-2] % get_sequence_parallel_world_size() != 0:
            get_runtime_state().split_text_embed_in_sp = False''', '''        if encoder_hidden_states.shape[-2] % get_sequence_parallel_world_size() != 0:
            get_runtime_state().split_text_embed_in_sp = False
            get_runtime_state().max_condition_sequence_length = encoder_hidden_states.shape[-2]'''))

# 4b. FLUX.2 runner wrapper: text not divisible by SP was torch.chunk-ed unevenly (ranks
#     disagree on the sequence length); image padding was attended to.
edit("xfuser/model_executor/models/transformers/transformer_flux2.py",
     ("""        else:
            hidden_states = USP(query, key, value, attn_layer=attn)
""", """        elif get_runtime_state().split_text_embed_in_sp or num_encoder_tokens == 0:
            hidden_states = USP(query, key, value, attn_layer=attn)
        else:
            # Text is replicated on every rank (its length is not divisible by the SP
            # degree): attend to it once, as joint tokens in front of the image tokens.
            text = num_encoder_tokens
            hidden_states = USP(
                query[:, :, text:],
                key[:, :, text:],
                value[:, :, text:],
                joint_query=query[:, :, :text],
                joint_key=key[:, :, :text],
                joint_value=value[:, :, :text],
                joint_strategy="front",
                attn_layer=attn,
            )
"""),
     ("""        else:
            hidden_states = USP(
                query, key, value, combine_qkv_a2a=True, attn_layer=attn
            )
""", """        elif get_runtime_state().split_text_embed_in_sp:
            hidden_states = USP(
                query, key, value, combine_qkv_a2a=True, attn_layer=attn
            )
        else:
            # Text is replicated on every rank (its length is not divisible by the SP
            # degree): attend to it once, as joint tokens in front of the image tokens.
            text = get_runtime_state().max_condition_sequence_length
            hidden_states = USP(
                query[:, :, text:],
                key[:, :, text:],
                value[:, :, text:],
                joint_query=query[:, :, :text],
                joint_key=key[:, :, :text],
                joint_value=value[:, :, :text],
                joint_strategy="front",
                attn_layer=attn,
            )
"""),
     ("""        if padding_length > 0:
            hidden_states = self._pad_to_sp_divisible(
                hidden_states, padding_length, dim=1
            )
            img_ids = self._pad_to_sp_divisible(img_ids, padding_length, dim=1)
""", """        if padding_length > 0:
            # Zero padding would be attended to by every query (there is no key mask here).
            raise ValueError(
                f"{sequence_length} image tokens are not divisible by the sequence parallel "
                f"degree {sp_world_size}; choose height and width so that "
                f"(height/16)*(width/16) is a multiple of {sp_world_size}"
            )
        # Text not divisible by the SP degree is replicated on every rank (torch.chunk
        # would split it unevenly); the attention processors pass it to USP as joint tokens.
        split_text = encoder_hidden_states.shape[-2] % sp_world_size == 0
        get_runtime_state().split_text_embed_in_sp = split_text
        get_runtime_state().max_condition_sequence_length = encoder_hidden_states.shape[-2]
"""),
     ("""        encoder_hidden_states = torch.chunk(
            encoder_hidden_states, get_sequence_parallel_world_size(), dim=-2
        )[get_sequence_parallel_rank()]
        img_ids = torch.chunk(img_ids, get_sequence_parallel_world_size(), dim=-2)[
            get_sequence_parallel_rank()
        ]
        txt_ids = torch.chunk(txt_ids, get_sequence_parallel_world_size(), dim=-2)[
            get_sequence_parallel_rank()
        ]
""", """        if split_text:
            encoder_hidden_states = torch.chunk(
                encoder_hidden_states, get_sequence_parallel_world_size(), dim=-2
            )[get_sequence_parallel_rank()]
        img_ids = torch.chunk(img_ids, get_sequence_parallel_world_size(), dim=-2)[
            get_sequence_parallel_rank()
        ]
        if split_text:
            txt_ids = torch.chunk(txt_ids, get_sequence_parallel_world_size(), dim=-2)[
                get_sequence_parallel_rank()
            ]
"""))

# 4c. Qwen-Image runner wrapper: text not divisible by SP was zero-padded into the keys
#     (attended to); image padding likewise; text masks are ignored by the processor.
edit("xfuser/model_executor/models/transformers/transformer_qwen.py",
     ("""from xfuser.core.distributed import (
    get_sequence_parallel_rank,""", """from xfuser.core.distributed import (
    get_runtime_state,
    get_sequence_parallel_rank,"""),
     ("""        joint_hidden_states = USP(
            joint_query.transpose(1, 2),
            joint_key.transpose(1, 2),
            joint_value.transpose(1, 2),
            dropout_p=0.0,
            is_causal=False,
            attn_layer=attn,
        ).transpose(1, 2)
""", """        if get_runtime_state().split_text_embed_in_sp:
            joint_hidden_states = USP(
                joint_query.transpose(1, 2),
                joint_key.transpose(1, 2),
                joint_value.transpose(1, 2),
                dropout_p=0.0,
                is_causal=False,
                attn_layer=attn,
            ).transpose(1, 2)
        else:
            # Text is replicated on every rank (its length is not divisible by the SP
            # degree): attend to it once, as joint tokens in front of the image tokens.
            joint_hidden_states = USP(
                img_query.transpose(1, 2),
                img_key.transpose(1, 2),
                img_value.transpose(1, 2),
                dropout_p=0.0,
                is_causal=False,
                joint_query=txt_query.transpose(1, 2),
                joint_key=txt_key.transpose(1, 2),
                joint_value=txt_value.transpose(1, 2),
                joint_strategy="front",
                attn_layer=attn,
            ).transpose(1, 2)
"""),
     ("""        text_seq_len, _, encoder_hidden_states_mask = compute_text_seq_len_from_mask(
            encoder_hidden_states, encoder_hidden_states_mask
        )
""", """        text_seq_len, _, encoder_hidden_states_mask = compute_text_seq_len_from_mask(
            encoder_hidden_states, encoder_hidden_states_mask
        )
        if encoder_hidden_states_mask is not None and not bool(encoder_hidden_states_mask.all()):
            # xFuserQwenDoubleStreamAttnProcessor passes no mask to USP.
            raise ValueError(
                "the text mask pads some prompts, and the sequence-parallel attention ignores "
                "masks; use one prompt per batch or prompts of the same token length"
            )
"""),
     ("""        pad_amount = (sp_world_size - (hidden_states.shape[1] % sp_world_size)) % sp_world_size
        encoder_pad_amount = (sp_world_size - (encoder_hidden_states.shape[1] % sp_world_size)) % sp_world_size
        hidden_states = chunk_and_pad_sequence(hidden_states, sp_world_rank, sp_world_size, pad_amount, dim=1)
        encoder_hidden_states = chunk_and_pad_sequence(encoder_hidden_states, sp_world_rank, sp_world_size, encoder_pad_amount, dim=1)

        image_rotary_emb = [
            chunk_and_pad_sequence(image_rotary_emb[0], sp_world_rank, sp_world_size, pad_amount, dim=0),
            chunk_and_pad_sequence(image_rotary_emb[1], sp_world_rank, sp_world_size, encoder_pad_amount, dim=0),
        ]
""", """        # Zero padding would be attended to by every query (USP gets no key mask).
        if hidden_states.shape[1] % sp_world_size:
            raise ValueError(
                f"{hidden_states.shape[1]} image tokens are not divisible by the sequence "
                f"parallel degree {sp_world_size}; choose height and width so that "
                f"(height/16)*(width/16) is a multiple of {sp_world_size}"
            )
        pad_amount = 0
        # Text not divisible by the SP degree is replicated on every rank; the attention
        # processor passes it to USP as joint tokens.
        split_text = encoder_hidden_states.shape[1] % sp_world_size == 0
        get_runtime_state().split_text_embed_in_sp = split_text
        hidden_states = chunk_and_pad_sequence(hidden_states, sp_world_rank, sp_world_size, pad_amount, dim=1)
        image_rotary_emb = [
            chunk_and_pad_sequence(image_rotary_emb[0], sp_world_rank, sp_world_size, pad_amount, dim=0),
            image_rotary_emb[1],
        ]
        if split_text:
            encoder_hidden_states = chunk_and_pad_sequence(encoder_hidden_states, sp_world_rank, sp_world_size, 0, dim=1)
            image_rotary_emb[1] = chunk_and_pad_sequence(image_rotary_emb[1], sp_world_rank, sp_world_size, 0, dim=0)
"""))

# 5. Runner on CPU: timing with perf_counter, no CUDA sync/moves without CUDA
edit("xfuser/model_executor/models/runner_models/base_model.py",
     ('''packages_info = PACKAGES_CHECKER.get_packages_info()
''', '''packages_info = PACKAGES_CHECKER.get_packages_info()


class _HostTimingEvent:
    """torch.cuda.Event(enable_timing=True) for runs without CUDA: time.perf_counter."""

    def record(self):
        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:
        return (end._t - self._t) * 1000.0


def _timing_event():
    if torch.cuda.is_available():
        return torch.cuda.Event(enable_timing=True)
    return _HostTimingEvent()


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
'''),
     ("import json\nimport os\n", "import json\nimport os\nimport time\n"),
     ('''        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)

        torch.cuda.synchronize()''', '''        start = _timing_event()
        end = _timing_event()

        _synchronize()'''),
     ('''        inference_start = torch.cuda.Event(enable_timing=True)
        inference_end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()''', '''        inference_start = _timing_event()
        inference_end = _timing_event()
        _synchronize()'''),
     ('''        inference_end.record()
        torch.cuda.synchronize()''', '''        inference_end.record()
        _synchronize()'''))
edit("xfuser/runner.py",
     ('''        torch.compiler.reset()
        torch.cuda.synchronize()''', '''        torch.compiler.reset()
        if torch.cuda.is_available():
            torch.cuda.synchronize()'''))
edit("xfuser/model_executor/models/runner_models/loading/placement.py",
     ('''    if not offload_requested:
        model.pipe = model.pipe.to(f"cuda:{local_rank}")''', '''    if not offload_requested and torch.cuda.is_available():
        model.pipe = model.pipe.to(f"cuda:{local_rank}")'''),
     ('''from xfuser.core.distributed import get_world_group''', '''import torch

from xfuser.core.distributed import get_world_group'''))

out = []
for rel, pairs in EDITS.items():
    src = (SITE / rel).read_text()
    new = src
    for a, b in pairs:
        assert new.count(a) == 1, (rel, a[:80], new.count(a))
        new = new.replace(a, b)
    if rel == "xfuser/config/args.py":
        assert new.count("\n        return parser\n") == 2
        new = patch_return_parser(new)
    out.append(f"diff -ruN a/{rel} b/{rel}\n")
    out.extend(difflib.unified_diff(src.splitlines(True), new.splitlines(True),
                                    f"a/{rel}", f"b/{rel}", n=3))
Path(sys.argv[1]).write_text("".join(out))
