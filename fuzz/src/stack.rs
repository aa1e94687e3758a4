//! Stack overflows as findings that libFuzzer can save.
//!
//! Without a sanitizer, libFuzzer's SIGSEGV handler runs on the faulting thread's stack; when
//! that stack has overflowed, the handler faults too and the process dies without writing the
//! input (and in fork mode the finding is lost). [`with_alt_stack`] gives the current thread
//! an alternate signal stack and makes the installed SIGSEGV/SIGBUS handlers use it, so the
//! overflow is reported as libFuzzer's "deadly signal" with a crash-* file.
//!
//! [`on_worker_stack`] runs decoding on a long-lived thread with a tokio worker's stack.

use std::cell::RefCell;
use std::sync::mpsc;
use std::sync::Once;

const ALT_STACK: usize = 256 << 10;

fn handlers_on_alt_stack() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for sig in [libc::SIGSEGV, libc::SIGBUS] {
            // SAFETY: reads the installed action and re-installs it with SA_ONSTACK added;
            // plain libc calls with valid pointers.
            unsafe {
                let mut act: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, std::ptr::null(), &mut act) != 0 {
                    continue;
                }
                if act.sa_sigaction == libc::SIG_DFL || act.sa_sigaction == libc::SIG_IGN {
                    continue;
                }
                if act.sa_flags & libc::SA_ONSTACK == 0 {
                    act.sa_flags |= libc::SA_ONSTACK;
                    libc::sigaction(sig, &act, std::ptr::null_mut());
                }
            }
        }
    });
}

/// Runs `f` with an alternate signal stack on this thread (unless it has one already).
pub fn with_alt_stack<R>(f: impl FnOnce() -> R) -> R {
    handlers_on_alt_stack();
    let mut mem = vec![0u8; ALT_STACK];
    // SAFETY: `mem` outlives the alternate stack's use: it is disabled before `mem` drops.
    let installed = unsafe {
        let mut old: libc::stack_t = std::mem::zeroed();
        libc::sigaltstack(std::ptr::null(), &mut old);
        if old.ss_flags & libc::SS_DISABLE == 0 {
            false
        } else {
            let st = libc::stack_t {
                ss_sp: mem.as_mut_ptr().cast(),
                ss_flags: 0,
                ss_size: mem.len(),
            };
            libc::sigaltstack(&st, std::ptr::null_mut()) == 0
        }
    };
    let r = f();
    if installed {
        // SAFETY: disables the alternate stack set above.
        unsafe {
            let st = libc::stack_t {
                ss_sp: std::ptr::null_mut(),
                ss_flags: libc::SS_DISABLE,
                ss_size: 0,
            };
            libc::sigaltstack(&st, std::ptr::null_mut());
        }
    }
    drop(mem);
    r
}

/// Stack size of a tokio worker thread, where a server decodes requests.
pub const WORKER_STACK: usize = 2 << 20;

type Job = Box<dyn FnOnce() + Send + 'static>;

struct Worker {
    jobs: mpsc::Sender<Job>,
    done: mpsc::Receiver<()>,
}

impl Worker {
    fn start() -> Worker {
        let (jobs, rx) = mpsc::channel::<Job>();
        let (tx, done) = mpsc::channel();
        std::thread::Builder::new()
            .name("decoder".into())
            .stack_size(WORKER_STACK)
            .spawn(move || {
                with_alt_stack(|| {
                    for job in rx {
                        job();
                        if tx.send(()).is_err() {
                            break;
                        }
                    }
                })
            })
            .expect("spawning the decoder thread");
        Worker { jobs, done }
    }
}

thread_local! {
    static WORKER: RefCell<Option<Worker>> = const { RefCell::new(None) };
}

/// Runs `f` on a thread with a tokio worker's stack ([`WORKER_STACK`]): decoding a recursive
/// type recurses once per nesting level of the input, and a stack overflow aborts the whole
/// server process. The thread is kept between calls (one per calling thread).
pub fn on_worker_stack<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let mut out: Option<std::thread::Result<R>> = None;
    {
        let slot = &mut out;
        let job: Box<dyn FnOnce() + Send + '_> = Box::new(move || {
            *slot = Some(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
        });
        // SAFETY: only the lifetime is erased. This function returns only after the worker
        // has run the job to its end (a panic inside is caught) and said so on `done`, so
        // nothing the job borrows is used after this block.
        let job: Job = unsafe { std::mem::transmute(job) };
        WORKER.with(|w| {
            let mut w = w.borrow_mut();
            let w = w.get_or_insert_with(Worker::start);
            w.jobs.send(job).expect("the decoder thread is gone");
            w.done.recv().expect("the decoder thread died");
        });
    }
    match out.expect("the job ran") {
        Ok(r) => r,
        Err(p) => std::panic::resume_unwind(p),
    }
}
