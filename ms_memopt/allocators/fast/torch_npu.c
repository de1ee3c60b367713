/* torch_npu's NPUCachingAllocator (ms_memopt/allocators/torch_npu.py): PyTorch's caching
 * allocator as Ascend's port runs it, so the same C models as torch.c and torch_expandable.c,
 * under their own kinds, with torch_npu's constant set here: every request is padded by 32
 * bytes before rounding (NPUCachingAllocator.cpp, round_size: kPadSize). Its options are the
 * shared state's: TorchState.page_1g (page_size:1g), ExpandableState.large_page
 * (segment_size_mb, page_size:1g) and ExpandableState.align (base_addr_aligned_kb, 16 KiB by
 * default, applied in torch_expandable.c's malloc). */
#include "fastpool.h"

#define NPU_PAD 32      /* round_size: kPadSize */

static int npu_torch_init(Core *c) {
    c->torch.pad = NPU_PAD;
    return 0;
}

static int npu_expandable_init(Core *c) {
    c->torch.pad = NPU_PAD;
    return fp_x_init(c);
}

const Model fp_torch_npu_model = {
    .kind = "torch_npu",
    .malloc = fp_torch_malloc,
    .free = fp_torch_free,
    .init = npu_torch_init,
    .segment_added = fp_torch_segment_added,
    .empty_cache = fp_torch_empty_cache,
    .note_segment_alloc = fp_torch_note_segment_alloc,
    .release_segment = fp_torch_release_segment,
    .pool_name = fp_torch_pool_name,
};

const Model fp_npu_expandable_model = {
    .kind = "npu_expandable",
    .malloc = fp_x_malloc,
    .free = fp_x_free,
    .init = npu_expandable_init,
    .empty_cache = fp_x_empty_cache,
    .release_segment = fp_x_release_segment,
    .note_segment_map = fp_x_note_segment_map,
    .unmap_range = fp_x_unmap_range,
};
