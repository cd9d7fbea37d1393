/*
 * A GPU timeline without Nsight Systems (the GPU machines have none): a
 * CUPTI injection library. Loaded into any CUDA program with
 *
 *   CUDA_INJECTION64_PATH=libcupti_timeline.so TIMELINE_OUT=FILE program ...
 *
 * it records every kernel, memcpy and memset the GPU ran and every CUDA
 * driver and runtime API call the host made, with their start and end on
 * one clock, and writes them to FILE as CSV when the program exits:
 *
 *   K,start_ns,end_ns,stream,correlation,name      a kernel
 *   C,start_ns,end_ns,stream,correlation,bytes     a memcpy
 *   S,start_ns,end_ns,stream,correlation,bytes     a memset
 *   D,start_ns,end_ns,thread,correlation,name      a driver API call
 *   R,start_ns,end_ns,thread,correlation,name      a runtime API call
 *
 * scripts/timeline_gaps.py reads it: where the GPU sat idle, and which host
 * calls it was waiting for. Built by scripts/cuda_bundle.sh against CUPTI's
 * headers from the `nvidia-cuda-cupti` wheel (no GPU needed).
 */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUFFER_BYTES (16u << 20)

static FILE *out;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *buffer = aligned_alloc(ACTIVITY_RECORD_ALIGNMENT, BUFFER_BYTES);
  *size = *buffer ? BUFFER_BYTES : 0;
  *max_records = 0;
}

static const char *api_name(CUpti_CallbackDomain domain, CUpti_CallbackId cbid) {
  const char *name = NULL;
  if (cuptiGetCallbackName(domain, cbid, &name) != CUPTI_SUCCESS || !name) {
    return "?";
  }
  return name;
}

/* A memcpy ('C') or memset ('S') line. */
static void transfer(char kind, uint64_t start, uint64_t end, uint32_t stream, uint32_t correlation,
                     uint64_t bytes) {
  fprintf(out, "%c,%llu,%llu,%u,%u,%llu\n", kind, (unsigned long long)start,
          (unsigned long long)end, stream, correlation, (unsigned long long)bytes);
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid) {
  (void)ctx;
  (void)stream;
  (void)size;
  CUpti_Activity *record = NULL;
  while (out && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
    case CUPTI_ACTIVITY_KIND_KERNEL: {
      CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10 *)record;
      fprintf(out, "K,%llu,%llu,%u,%u,%s\n", (unsigned long long)k->start,
              (unsigned long long)k->end, k->streamId, k->correlationId, k->name);
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      CUpti_ActivityMemcpy6 *m = (CUpti_ActivityMemcpy6 *)record;
      transfer('C', m->start, m->end, m->streamId, m->correlationId, m->bytes);
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      CUpti_ActivityMemset4 *m = (CUpti_ActivityMemset4 *)record;
      transfer('S', m->start, m->end, m->streamId, m->correlationId, m->bytes);
      break;
    }
    case CUPTI_ACTIVITY_KIND_DRIVER:
    case CUPTI_ACTIVITY_KIND_RUNTIME: {
      CUpti_ActivityAPI *a = (CUpti_ActivityAPI *)record;
      int driver = record->kind == CUPTI_ACTIVITY_KIND_DRIVER;
      fprintf(out, "%c,%llu,%llu,%u,%u,%s\n", driver ? 'D' : 'R', (unsigned long long)a->start,
              (unsigned long long)a->end, a->threadId, a->correlationId,
              api_name(driver ? CUPTI_CB_DOMAIN_DRIVER_API : CUPTI_CB_DOMAIN_RUNTIME_API,
                       a->cbid));
      break;
    }
    default:
      break;
    }
  }
  free(buffer);
}

static void at_exit(void) {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  if (out) {
    fclose(out);
    out = NULL;
  }
}

/* CUDA calls this once, when it loads the library named by
 * CUDA_INJECTION64_PATH; returning nonzero means success. */
int InitializeInjection(void) {
  const char *path = getenv("TIMELINE_OUT");
  out = fopen(path ? path : "timeline.csv", "w");
  if (!out) {
    perror("cupti_timeline: opening TIMELINE_OUT");
    return 0;
  }
  CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_DRIVER,
                                CUPTI_ACTIVITY_KIND_RUNTIME};
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
    CUptiResult r = cuptiActivityEnable(kinds[i]);
    if (r != CUPTI_SUCCESS) {
      const char *why = NULL;
      cuptiGetResultString(r, &why);
      fprintf(stderr, "cupti_timeline: enabling activity %d: %s\n", (int)kinds[i], why ? why : "?");
    }
  }
  cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  atexit(at_exit);
  return 1;
}
