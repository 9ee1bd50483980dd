/* Counts the MPI collectives that one thread makes, and their bytes: an LD_PRELOAD
 * shim over the PMPI profiling interface, for benchmarks/common.py (MpiCounter).
 *
 *   mpicc -shared -fPIC -o mpi_count.so benchmarks/mpi_count.c
 *   LD_PRELOAD=.../mpi_count.so mpirun ... python ...
 *
 * mpi_count_start() arms the counter for the calling thread only (the Python main
 * thread), so Horovod's background thread, which polls MPI every cycle, is not counted;
 * mpi_count_start_all() counts every thread but those that called MPI while
 * mpi_count_learn(1) was on (for TensorFlow, whose ops run on its own threads);
 * mpi_count_stop() disarms it; mpi_count_get(kind, &calls, &bytes) reads the totals.
 * Bytes are what this rank contributes: count x type size (allgather: its send part).
 * Point-to-point sends count as SEND: hvd_syncbn's MPI transport sums by recursive
 * doubling over Isend/Irecv, log2(W) sends per allreduce (one at 2 ranks).
 */
#include <mpi.h>
#include <pthread.h>

enum { ALLREDUCE, ALLGATHER, BCAST, OTHER, SEND, KINDS };
static long long calls[KINDS], bytes[KINDS];
static pthread_t owner;
static volatile int armed;

static pthread_t ignored[16];
static int n_ignored, learning, all_threads;

static void note(int kind, int count, MPI_Datatype type) {
  int size = 0;
  pthread_t me = pthread_self();
  if (learning) {
    for (int i = 0; i < n_ignored; i++)
      if (pthread_equal(me, ignored[i])) return;
    if (n_ignored < 16) ignored[n_ignored++] = me;
    return;
  }
  if (!armed) return;
  if (all_threads) {
    for (int i = 0; i < n_ignored; i++)
      if (pthread_equal(me, ignored[i])) return;
  } else if (!pthread_equal(me, owner)) {
    return;
  }
  if (type != MPI_DATATYPE_NULL) PMPI_Type_size(type, &size);
  calls[kind] += 1;
  bytes[kind] += (long long)count * size;
}

void mpi_count_start(void) {
  for (int k = 0; k < KINDS; k++) calls[k] = bytes[k] = 0;
  owner = pthread_self();
  all_threads = 0;
  armed = 1;
}
/* Learning mode: every thread that calls MPI meanwhile (an idle Horovod's background
 * thread polling its peers) is ignored by mpi_count_start_all(). */
void mpi_count_learn(int on) { learning = on; }
int mpi_count_ignored(void) { return n_ignored; }
void mpi_count_start_all(void) {
  for (int k = 0; k < KINDS; k++) calls[k] = bytes[k] = 0;
  all_threads = 1;
  armed = 1;
}
void mpi_count_stop(void) { armed = 0; }
void mpi_count_get(int kind, long long *c, long long *b) { *c = calls[kind]; *b = bytes[kind]; }

int MPI_Allreduce(const void *s, void *r, int n, MPI_Datatype t, MPI_Op op, MPI_Comm comm) {
  note(ALLREDUCE, n, t);
  return PMPI_Allreduce(s, r, n, t, op, comm);
}
int MPI_Iallreduce(const void *s, void *r, int n, MPI_Datatype t, MPI_Op op, MPI_Comm comm, MPI_Request *q) {
  note(ALLREDUCE, n, t);
  return PMPI_Iallreduce(s, r, n, t, op, comm, q);
}
int MPI_Isend(const void *b, int n, MPI_Datatype t, int dest, int tag, MPI_Comm comm, MPI_Request *q) {
  note(SEND, n, t);
  return PMPI_Isend(b, n, t, dest, tag, comm, q);
}
int MPI_Send(const void *b, int n, MPI_Datatype t, int dest, int tag, MPI_Comm comm) {
  note(SEND, n, t);
  return PMPI_Send(b, n, t, dest, tag, comm);
}
int MPI_Allgather(const void *s, int sn, MPI_Datatype st, void *r, int rn, MPI_Datatype rt, MPI_Comm comm) {
  note(ALLGATHER, sn, st);
  return PMPI_Allgather(s, sn, st, r, rn, rt, comm);
}
int MPI_Allgatherv(const void *s, int sn, MPI_Datatype st, void *r, const int *rn, const int *d,
                   MPI_Datatype rt, MPI_Comm comm) {
  note(ALLGATHER, sn, st);
  return PMPI_Allgatherv(s, sn, st, r, rn, d, rt, comm);
}
int MPI_Bcast(void *b, int n, MPI_Datatype t, int root, MPI_Comm comm) {
  note(BCAST, n, t);
  return PMPI_Bcast(b, n, t, root, comm);
}
int MPI_Reduce(const void *s, void *r, int n, MPI_Datatype t, MPI_Op op, int root, MPI_Comm comm) {
  note(OTHER, n, t);
  return PMPI_Reduce(s, r, n, t, op, root, comm);
}
int MPI_Reduce_scatter_block(const void *s, void *r, int n, MPI_Datatype t, MPI_Op op, MPI_Comm comm) {
  note(OTHER, n, t);
  return PMPI_Reduce_scatter_block(s, r, n, t, op, comm);
}
